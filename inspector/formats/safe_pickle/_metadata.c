/* A DCP .metadata pickle read straight into the reader's entries, for the common case.
 *
 * entries(data, file_sizes, consts) runs pickle's opcodes over plain C nodes (no Python
 * object is made while decoding, nothing is resolved or called), then builds the Entry of
 * every key. It only ever accepts: a protocol 4-5 pickle of the opcodes torch's pickler
 * writes for Metadata, naming only the metadata globals, whose tables are all sound (every
 * key a tensor or object with one well-formed storage record per chunk, inside its file,
 * the chunks tiling the shape; no record or key given twice, no list shared). For anything
 * else it returns None and the caller decodes the file with the unpickler and builds the
 * entries in Python, which names the problem. So None is never a verdict, and what it
 * returns is what that path would build (tests/formats/test_metadata_decoder.py compares
 * the two on genuine, mutated and random files).
 *
 * file_sizes(names: set[str]) -> {name: size} is called once, with every file the storage
 * records name. consts: ({torch.<name>: dtype name}, ChunkInfo, Entry, layout_problem,
 * components.component_of). Entries carry their component where planner_data gives paths.
 * Returns (entries, planner_data is a dict, version, checkpoint_id), where checkpoint_id is
 * None, a str, or ("posix" | "windows", parts) for a pickled path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIMS 64
#define MAX_INT (1LL << 62)
#define MAX_PATH_INDEX (1LL << 20)
#define MAX_PATH 64
#define MAX_FIELDS 6
#define FEW 8 /* chunks per key handled without allocating */
#define UNSET UINT32_MAX
#if defined(__GNUC__) || defined(__clang__)
#define IN_LOOP inline __attribute__((always_inline)) /* step: its loop, without a call per opcode */
#else
#define IN_LOOP inline
#endif
/* Fixed nodes: the singletons pickle pushes. */
#define NONE_ID 0
#define TRUE_ID 1
#define FALSE_ID 2
#define EMPTY_ID 3
#define LAYOUT_ID 4
#define SMALL_ID 5 /* then the ints 0 .. SMALL_INTS - 1, one node each (most ints are small) */
#define SMALL_INTS 256

enum { K_NONE, K_TRUE, K_FALSE, K_INT, K_STR, K_TUPLE, K_LIST, K_DICT, K_CLASS, K_FUNC,
       K_DTYPE, K_OBJ, K_LAYOUT, K_PATH, K_SPENT /* a dict BUILD took as state: its items reused */ };
enum { C_METADATA, C_INDEX, C_TENSOR, C_BYTES, C_CHUNK, C_PROPERTIES, C_STORAGE_META,
       C_STORAGE_INFO, N_CLASSES };
enum { F_SIZE, F_LAYOUT, F_MEMORY_FORMAT, F_POSIX, F_WINDOWS };
enum { DECLINE = 1, FAIL = -1 };

/* Field names of each class, in slot order (the stand-ins' in metadata.py). */
static const char *const FIELDS[N_CLASSES][MAX_FIELDS] = {
    {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version",
     "all_local_plans"},
    {"fqn", "offset", "index"},
    {"properties", "size", "chunks"},
    {NULL},
    {"offsets", "sizes"},
    {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"},
    {"checkpoint_id", "save_id", "load_id", "modules"},
    {"relative_path", "offset", "length", "transform_descriptors"},
};
static const char *const CLASS_NAMES[N_CLASSES] = {
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_StorageInfo"};

/* A decoded value, in 16 bytes (there are millions). Tuples, lists and dicts hold their
 * items (dicts: key, value pairs) at pool[a .. a + b) (lists and dicts room for cap); an
 * object holds its class's field slots at pool[a]; a string is the text at data[a], its
 * length the sub bytes before it (as pickled), and its str in i once made; an int is i; a
 * path's parts are the tuple node a. sub: also an object's class, a global's kind, and for a
 * list whether a key took it as its chunks. */
typedef struct {
    uint8_t kind, sub;
    uint32_t a;
    union {
        int64_t i;
        struct {
            uint32_t b, cap;
        };
    };
} Node;
_Static_assert(sizeof(Node) == 16, "a node is 16 bytes");

/* The number of fields of a class (its pool slots), at least one. */
static int
field_count(int cls)
{
    int n = 0;
    while (n < MAX_FIELDS && FIELDS[cls][n] != NULL) n++;
    return n ? n : 1;
}

/* --- growable storage: the only code that touches the arrays ----------------------------
 *
 * Rules (tests/native/test_rules.py checks them on the source): the growable arrays (nodes,
 * pool, stack, memo, marks, and Build's made) are named only between the STORAGE markers;
 * everything else reads a node as a copy (node()), writes one field through node_w() in the
 * same expression, and holds indices, never pointers, so no pointer into an array survives
 * a call that may grow it. Every index is checked: one out of range marks the run broken
 * (its verdict is then DECLINE) and reads a poison node no opcode accepts; a build with
 * -DINSPECTOR_NATIVE_STRICT (the sanitizer test's) aborts there instead. Sizes an input
 * supplies are summed with add_size() (checked). */
/* STORAGE BEGIN */
typedef struct {
    const unsigned char *data;
    size_t size, pos, op, frame_end; /* op: where the opcode being run starts */
    Node *nodes;
    size_t n_nodes, cap_nodes;
    uint32_t *pool, *stack, *memo;
    size_t n_pool, cap_pool, n_stack, cap_stack, n_memo, cap_memo;
    size_t *marks;
    size_t n_marks, cap_marks;
    Node scratch; /* what node_w() gives for an index out of range */
    int broken;   /* an index was out of range: the run declines */
    long long path_budget;
    PyObject *dtypes; /* {torch.<name>: dtype name} */
    uint32_t field_names[N_CLASSES][MAX_FIELDS]; /* the string node last found naming each */
} Vm;

/* An index out of range: a bug the checks contain (strict builds stop at it). */
static void
out_of_range(Vm *vm)
{
#ifdef INSPECTOR_NATIVE_STRICT
    (void)vm;
    abort();
#else
    vm->broken = 1;
#endif
}

/* a + b into *sum; 0 where it does not fit. */
static inline int
add_size(size_t a, size_t b, size_t *sum)
{
    return !__builtin_add_overflow(a, b, sum);
}

static int
grow(void **items, size_t *cap, size_t need, size_t item)
{
    if (need <= *cap) return 0;
    size_t wanted = *cap ? *cap : 64, bytes;
    while (wanted < need) {
        if (__builtin_mul_overflow(wanted, 2, &wanted)) return PyErr_NoMemory(), FAIL;
    }
    if (__builtin_mul_overflow(wanted, item, &bytes)) return PyErr_NoMemory(), FAIL;
    void *bigger = PyMem_Realloc(*items, bytes);
    if (bigger == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    *items = bigger;
    *cap = wanted;
    return 0;
}

/* Room for what genuine metadata of its size holds (a node per 7-10 bytes), so that
 * growing seldom copies. */
static int
reserve(Vm *vm)
{
    if (grow((void **)&vm->nodes, &vm->cap_nodes, vm->size / 6 + 64, sizeof(Node))
        || grow((void **)&vm->memo, &vm->cap_memo, vm->size / 8 + 64, sizeof(uint32_t))
        || grow((void **)&vm->pool, &vm->cap_pool, vm->size / 3 + 64, sizeof(uint32_t)))
        return FAIL;
    return 0;
}

static void
release(Vm *vm)
{
    PyMem_Free(vm->nodes);
    PyMem_Free(vm->pool);
    PyMem_Free(vm->stack);
    PyMem_Free(vm->memo);
    PyMem_Free(vm->marks);
}

/* A copy of node `id` (the poison node, kind K_SPENT, where there is none). */
static inline Node
node(Vm *vm, uint32_t id)
{
    if (id < vm->n_nodes) return vm->nodes[id];
    out_of_range(vm);
    return (Node){.kind = K_SPENT};
}

/* Node `id` to write one field of, in the same expression (the scratch node where there is
 * none). Never kept: the next new_node() may move the array. */
static inline Node *
node_w(Vm *vm, uint32_t id)
{
    if (id < vm->n_nodes) return &vm->nodes[id];
    out_of_range(vm);
    vm->scratch = (Node){.kind = K_SPENT};
    return &vm->scratch;
}

static int
new_node(Vm *vm, uint8_t kind, uint32_t *id)
{
    if (vm->n_nodes >= UNSET) return DECLINE;
    if (grow((void **)&vm->nodes, &vm->cap_nodes, vm->n_nodes + 1, sizeof(Node))) return FAIL;
    vm->nodes[vm->n_nodes] = (Node){.kind = kind};
    *id = (uint32_t)vm->n_nodes++;
    return 0;
}

static inline uint32_t
pool_get(Vm *vm, size_t at)
{
    if (at < vm->n_pool) return vm->pool[at];
    out_of_range(vm);
    return UNSET;
}

static inline void
pool_set(Vm *vm, size_t at, uint32_t value)
{
    if (at < vm->n_pool) vm->pool[at] = value;
    else out_of_range(vm);
}

/* n pool slots, their start in *at. */
static int
take(Vm *vm, size_t n, uint32_t *at)
{
    size_t end;
    if (!add_size(vm->n_pool, n, &end) || end >= UNSET) return DECLINE;
    if (grow((void **)&vm->pool, &vm->cap_pool, end, sizeof(uint32_t))) return FAIL;
    *at = (uint32_t)vm->n_pool;
    vm->n_pool = end;
    return 0;
}

/* Whether [at, at + n) lies inside [0, limit). */
static inline int
within(size_t at, size_t n, size_t limit)
{
    size_t end;
    return add_size(at, n, &end) && end <= limit;
}

/* pool[to .. to + n) = pool[from .. from + n) (n: a count of slots already taken). */
static void
pool_copy(Vm *vm, size_t to, size_t from, size_t n)
{
    if (within(to, n, vm->n_pool) && within(from, n, vm->n_pool))
        memmove(vm->pool + to, vm->pool + from, n * sizeof(uint32_t));
    else out_of_range(vm);
}

/* pool[to .. to + n) = the stack's items from `from` on (popped by the caller). */
static void
pool_from_stack(Vm *vm, size_t to, size_t from, size_t n)
{
    if (within(to, n, vm->n_pool) && within(from, n, vm->n_stack))
        memcpy(vm->pool + to, vm->stack + from, n * sizeof(uint32_t));
    else out_of_range(vm);
}

static int
push(Vm *vm, uint32_t id)
{
    if (grow((void **)&vm->stack, &vm->cap_stack, vm->n_stack + 1, sizeof(uint32_t))) return FAIL;
    vm->stack[vm->n_stack++] = id;
    return 0;
}

/* The stack item at height k. */
static inline uint32_t
stack_get(Vm *vm, size_t k)
{
    if (k < vm->n_stack) return vm->stack[k];
    out_of_range(vm);
    return UNSET;
}

/* The item `depth` below the top (1: the top). */
static inline uint32_t
stack_top(Vm *vm, size_t depth)
{
    return depth <= vm->n_stack ? stack_get(vm, vm->n_stack - depth) : stack_get(vm, SIZE_MAX);
}

static int
memoize(Vm *vm, uint32_t id)
{
    if (grow((void **)&vm->memo, &vm->cap_memo, vm->n_memo + 1, sizeof(uint32_t))) return FAIL;
    vm->memo[vm->n_memo++] = id;
    return 0;
}

/* Memo entry `at`, or UNSET (DECLINE) where there is none. */
static inline uint32_t
memo_get(Vm *vm, size_t at)
{
    return at < vm->n_memo ? vm->memo[at] : UNSET;
}

static int
push_mark(Vm *vm)
{
    if (grow((void **)&vm->marks, &vm->cap_marks, vm->n_marks + 1, sizeof(size_t))) return FAIL;
    vm->marks[vm->n_marks++] = vm->n_stack;
    return 0;
}

/* The stack height at the last mark (0 without one: the stack's bottom). */
static inline size_t
last_mark(const Vm *vm)
{
    return vm->n_marks ? vm->marks[vm->n_marks - 1] : 0;
}

/* Pops the last mark: the stack height it stood at, in *at; DECLINE without one, or when
 * the container the opcode adds to would lie below the mark before it. */
static int
pop_mark(Vm *vm, size_t *at, int container)
{
    if (vm->n_marks == 0) return DECLINE;
    *at = vm->marks[--vm->n_marks];
    return container && *at <= last_mark(vm) ? DECLINE : 0;
}
/* STORAGE END */

/* Items above the last mark (pickle's fence: nothing below it may be popped). */
static size_t
above_fence(const Vm *vm)
{
    return vm->n_stack - last_mark(vm);
}

static int
valid_utf8(const unsigned char *s, size_t n)
{
    /* UTF-8 as pickle decodes it ("surrogatepass": encoded surrogates are accepted). */
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
        if (len == 0 || c > 0xF4 || i + len > n) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
        }
        if ((c == 0xE0 && s[i + 1] < 0xA0) || (c == 0xF0 && s[i + 1] < 0x90)
            || (c == 0xF4 && s[i + 1] > 0x8F))
            return 0;
        i += len;
    }
    return 1;
}

static size_t
code_points(const unsigned char *s, size_t n)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += (s[i] & 0xC0) != 0x80;
    return count;
}

static uint64_t
little(const unsigned char *p, size_t n)
{
    uint64_t value = 0;
    for (size_t k = n; k > 0; k--) value = value << 8 | p[k - 1];
    return value;
}

/* The text of string node n (its length, pickled just before it, in *length); an empty
 * text for any other node. */
static const unsigned char *
text_of(Vm *vm, Node n, size_t *length)
{
    *length = 0;
    if (n.kind != K_STR || n.sub > 8 || n.a < n.sub || n.a > vm->size) {
        if (n.kind != K_SPENT) out_of_range(vm);
        return vm->data;
    }
    size_t found = (size_t)little(vm->data + n.a - n.sub, n.sub);
    if (found > vm->size - n.a) out_of_range(vm);
    else *length = found;
    return vm->data + n.a;
}

static int
same_text(Vm *vm, uint32_t id, const char *text)
{
    Node n = node(vm, id);
    if (n.kind != K_STR) return 0;
    size_t length, wanted = strlen(text);
    const unsigned char *p = text_of(vm, n, &length);
    return length == wanted && memcmp(p, text, wanted) == 0;
}

/* The next n argument bytes of the opcode being run, inside the data and its frame. */
static const unsigned char *
argument(Vm *vm, size_t n)
{
    size_t at = vm->pos, end;
    if (!add_size(at, n, &end) || end > vm->size) return NULL;
    if (vm->op < vm->frame_end && end > vm->frame_end) return NULL;
    vm->pos = end;
    return vm->data + at;
}

static int
push_int(Vm *vm, int64_t value)
{
    if (value >= 0 && value < SMALL_INTS) return push(vm, SMALL_ID + (uint32_t)value);
    uint32_t id;
    int status = new_node(vm, K_INT, &id);
    if (status) return status;
    node_w(vm, id)->i = value;
    return push(vm, id);
}

static int
push_string(Vm *vm, size_t width)
{
    const unsigned char *p = argument(vm, width);
    if (p == NULL) return DECLINE;
    uint64_t n = little(p, width);
    const unsigned char *text = n <= UINT32_MAX ? argument(vm, (size_t)n) : NULL;
    if (text == NULL || !valid_utf8(text, (size_t)n)) return DECLINE;
    uint32_t id;
    int status = new_node(vm, K_STR, &id);
    if (status) return status;
    node_w(vm, id)->a = (uint32_t)(text - vm->data);
    node_w(vm, id)->sub = (uint8_t)width;
    return push(vm, id);
}

/* The top n stack items as a tuple, in their place. */
static int
push_tuple(Vm *vm, size_t n)
{
    if (n == 0) return push(vm, EMPTY_ID);
    if (n > vm->n_stack) return DECLINE;
    uint32_t id, at;
    int status = new_node(vm, K_TUPLE, &id);
    if (status || (status = take(vm, n, &at))) return status;
    pool_from_stack(vm, at, vm->n_stack - n, n);
    vm->n_stack -= n;
    node_w(vm, id)->a = at;
    node_w(vm, id)->b = (uint32_t)n;
    return push(vm, id);
}

/* Resolves STACK_GLOBAL's (module, name) to a metadata global, as policy.metadata_global
 * does for the names genuine metadata uses; DECLINE for any other. */
static int
global(Vm *vm, uint32_t module, uint32_t name)
{
    uint8_t kind = K_CLASS, sub = 0;
    int64_t value = 0;
    if (same_text(vm, module, "torch.distributed.checkpoint.metadata")) {
        if (same_text(vm, name, "_MEM_FORMAT_ENCODING")) kind = K_FUNC, sub = F_MEMORY_FORMAT;
        else {
            for (sub = 0; sub < C_STORAGE_INFO && !same_text(vm, name, CLASS_NAMES[sub]); sub++);
            if (sub == C_STORAGE_INFO) return DECLINE;
        }
    } else if (same_text(vm, module, "torch.distributed.checkpoint.filesystem")) {
        if (!same_text(vm, name, "_StorageInfo")) return DECLINE;
        sub = C_STORAGE_INFO;
    } else if (same_text(vm, module, "torch.serialization")) {
        if (!same_text(vm, name, "_get_layout")) return DECLINE;
        kind = K_FUNC, sub = F_LAYOUT;
    } else if (same_text(vm, module, "pathlib") || same_text(vm, module, "pathlib._local")) {
        kind = K_FUNC;
        if (same_text(vm, name, "PosixPath") || same_text(vm, name, "PurePosixPath")
            || same_text(vm, name, "Path"))
            sub = F_POSIX;
        else if (same_text(vm, name, "WindowsPath") || same_text(vm, name, "PureWindowsPath"))
            sub = F_WINDOWS;
        else return DECLINE;
    } else if (same_text(vm, module, "torch")) {
        if (same_text(vm, name, "Size")) {
            kind = K_FUNC, sub = F_SIZE;
        } else {
            Node n = node(vm, name);
            if (n.kind != K_STR) return DECLINE;
            size_t length;
            const unsigned char *p = text_of(vm, n, &length);
            PyObject *text = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)length,
                                                  "surrogatepass");
            if (text == NULL) return FAIL;
            PyObject *found = PyDict_GetItemWithError(vm->dtypes, text);
            Py_DECREF(text);
            if (found == NULL) return PyErr_Occurred() ? FAIL : DECLINE;
            kind = K_DTYPE;
            value = name; /* the node holding the name, looked up again when built */
        }
    } else {
        return DECLINE;
    }
    uint32_t id;
    int status = new_node(vm, kind, &id);
    if (status) return status;
    node_w(vm, id)->sub = sub;
    node_w(vm, id)->i = value;
    return push(vm, id);
}

static int
reduce(Vm *vm, uint32_t callable, uint32_t args)
{
    Node f = node(vm, callable), t = node(vm, args);
    if (f.kind != K_FUNC || (t.kind != K_TUPLE && args != EMPTY_ID)) return DECLINE;
    uint32_t n = args == EMPTY_ID ? 0 : t.b, id, first = n ? pool_get(vm, t.a) : UNSET;
    if (f.sub == F_SIZE) { /* ().__add__(tuple): that same tuple */
        if (n != 1 || (node(vm, first).kind != K_TUPLE && first != EMPTY_ID)) return DECLINE;
        return push(vm, first);
    }
    if (f.sub == F_LAYOUT)
        return n == 1 && same_text(vm, first, "torch.strided") ? push(vm, LAYOUT_ID) : DECLINE;
    if (f.sub == F_MEMORY_FORMAT) { /* the code itself, 0, 1 or 2 */
        if (n != 1) return DECLINE;
        Node code = node(vm, first);
        return code.kind == K_INT && code.i >= 0 && code.i <= 2 ? push(vm, first) : DECLINE;
    }
    for (uint32_t k = 0; k < n; k++) { /* a path: its parts, charged as policy charges them */
        Node part = node(vm, pool_get(vm, (size_t)t.a + k));
        if (part.kind != K_STR) return DECLINE;
        size_t length;
        const unsigned char *p = text_of(vm, part, &length);
        vm->path_budget -= (long long)code_points(p, length);
        if (vm->path_budget < 0) return DECLINE;
    }
    int status = new_node(vm, K_PATH, &id); /* may move the nodes: f and t are copies */
    if (status) return status;
    node_w(vm, id)->sub = f.sub;
    node_w(vm, id)->a = args;
    return push(vm, id);
}

static int
field_index(Vm *vm, int cls, uint32_t name)
{
    for (int k = 0; k < MAX_FIELDS && FIELDS[cls][k] != NULL; k++) {
        if (vm->field_names[cls][k] == name) return k; /* its memoised name, seen before */
    }
    for (int k = 0; k < MAX_FIELDS && FIELDS[cls][k] != NULL; k++) {
        if (same_text(vm, name, FIELDS[cls][k])) {
            vm->field_names[cls][k] = name;
            return k;
        }
    }
    return -1;
}

/* BUILD: a dict state updates the instance's fields; TensorProperties also takes torch's
 * 5-tuple. Anything else, or a field the class has not, is declined. */
static int
build(Vm *vm, uint32_t inst, uint32_t state)
{
    Node obj = node(vm, inst), s = node(vm, state);
    if (obj.kind != K_OBJ || obj.sub >= N_CLASSES) return DECLINE;
    if (obj.sub == C_PROPERTIES && s.kind == K_TUPLE && s.b == 5) {
        pool_copy(vm, obj.a, s.a, 5);
        return 0;
    }
    if (s.kind != K_DICT) return DECLINE;
    for (uint32_t k = 0; k + 1 < s.b; k += 2) {
        int at = field_index(vm, obj.sub, pool_get(vm, (size_t)s.a + k));
        if (at < 0) return DECLINE;
        pool_set(vm, (size_t)obj.a + (size_t)at, pool_get(vm, (size_t)s.a + k + 1));
    }
    /* read once, as genuine states are: its room is reused */
    if ((size_t)s.a + s.cap == vm->n_pool) vm->n_pool = s.a;
    node_w(vm, state)->kind = K_SPENT;
    return 0;
}

/* Adds n stack items to the list or dict at stack[at - 1] (n even for a dict). */
static int
extend(Vm *vm, size_t at, size_t n)
{
    if (at == 0) return DECLINE;
    uint32_t container = stack_get(vm, at - 1);
    Node c = node(vm, container);
    if (c.kind != K_LIST && c.kind != K_DICT) return DECLINE;
    if (c.kind == K_DICT) {
        if (n % 2) return DECLINE;
        for (size_t k = at; k < at + n; k += 2) { /* keys Python can hash, of kinds read here */
            uint8_t kind = node(vm, stack_get(vm, k)).kind;
            if (kind != K_STR && kind != K_INT && kind != K_OBJ && kind > K_FALSE) return DECLINE;
        }
    }
    size_t size;
    if (!add_size(c.b, n, &size) || size >= UNSET) return DECLINE;
    if (size > c.cap) {
        uint32_t moved;
        size_t cap = (size_t)c.cap * 2 > size ? (size_t)c.cap * 2 : size;
        if (cap >= UNSET) return DECLINE;
        int status = take(vm, cap, &moved);
        if (status) return status;
        pool_copy(vm, moved, c.a, c.b);
        node_w(vm, container)->a = c.a = moved;
        node_w(vm, container)->cap = c.cap = (uint32_t)cap;
    }
    pool_from_stack(vm, (size_t)c.a + c.b, at, n);
    node_w(vm, container)->b = (uint32_t)size;
    vm->n_stack = at;
    return 0;
}

static IN_LOOP int
step(Vm *vm, int *done)
{
    const unsigned char *p;
    unsigned char op = vm->data[vm->pos];
    uint32_t id, a, b;
    size_t at;
    int status;
    vm->op = vm->pos++;
    switch (op) {
    case 0x80: /* PROTO */
        if (vm->op != 0 || (p = argument(vm, 1)) == NULL || (*p != 4 && *p != 5)) return DECLINE;
        return 0;
    case 0x95: /* FRAME: at an opcode boundary outside any frame, inside the data */
        if (vm->op < vm->frame_end || (p = argument(vm, 8)) == NULL) return DECLINE;
        if (little(p, 8) > vm->size - vm->pos) return DECLINE;
        vm->frame_end = vm->pos + (size_t)little(p, 8);
        return 0;
    case 0x8c: return push_string(vm, 1); /* SHORT_BINUNICODE */
    case 'X': return push_string(vm, 4);  /* BINUNICODE */
    case 0x8d: return push_string(vm, 8); /* BINUNICODE8 */
    case 0x94: /* MEMOIZE */
        if (vm->n_stack == 0) return DECLINE;
        return memoize(vm, stack_top(vm, 1));
    case 'h': /* BINGET */
    case 'j': /* LONG_BINGET */
        if ((p = argument(vm, op == 'h' ? 1 : 4)) == NULL) return DECLINE;
        id = memo_get(vm, (size_t)little(p, op == 'h' ? 1 : 4));
        return id == UNSET ? DECLINE : push(vm, id);
    case 'K': /* BININT1 */
        return (p = argument(vm, 1)) ? push_int(vm, p[0]) : DECLINE;
    case 'M': /* BININT2 */
        return (p = argument(vm, 2)) ? push_int(vm, (int64_t)little(p, 2)) : DECLINE;
    case 'J': /* BININT */
        return (p = argument(vm, 4)) ? push_int(vm, (int32_t)(uint32_t)little(p, 4)) : DECLINE;
    case 0x8a: /* LONG1: up to 8 bytes, two's complement */
        if ((p = argument(vm, 1)) == NULL || *p > 8) return DECLINE;
        at = *p;
        if ((p = argument(vm, at)) == NULL) return DECLINE;
        if (at == 0) return push_int(vm, 0);
        {
            uint64_t raw = little(p, at);
            if (at < 8 && (p[at - 1] & 0x80)) raw |= ~(uint64_t)0 << (8 * at);
            return push_int(vm, (int64_t)raw);
        }
    case 'N': return push(vm, NONE_ID);
    case 0x88: return push(vm, TRUE_ID);
    case 0x89: return push(vm, FALSE_ID);
    case ')': return push(vm, EMPTY_ID);
    case 0x85: /* TUPLE1, TUPLE2, TUPLE3 */
    case 0x86:
    case 0x87:
        return above_fence(vm) < (size_t)(op - 0x84) ? DECLINE : push_tuple(vm, op - 0x84);
    case '(': /* MARK */
        return push_mark(vm);
    case 't': /* TUPLE */
        if ((status = pop_mark(vm, &at, 0))) return status;
        return push_tuple(vm, vm->n_stack - at);
    case ']': /* EMPTY_LIST */
    case '}': /* EMPTY_DICT */
        if ((status = new_node(vm, op == ']' ? K_LIST : K_DICT, &id))) return status;
        return push(vm, id);
    case 'a': /* APPEND */
        if (above_fence(vm) < 2 || node(vm, stack_top(vm, 2)).kind != K_LIST) return DECLINE;
        return extend(vm, vm->n_stack - 1, 1);
    case 's': /* SETITEM */
        if (above_fence(vm) < 3 || node(vm, stack_top(vm, 3)).kind != K_DICT) return DECLINE;
        return extend(vm, vm->n_stack - 2, 2);
    case 'e': /* APPENDS */
    case 'u': /* SETITEMS */
        if ((status = pop_mark(vm, &at, 1))) return status;
        if (node(vm, stack_get(vm, at - 1)).kind != (op == 'e' ? K_LIST : K_DICT)) return DECLINE;
        return extend(vm, at, vm->n_stack - at);
    case 0x81: /* NEWOBJ: a metadata class, no arguments */
        if (above_fence(vm) < 2) return DECLINE;
        a = stack_top(vm, 2), b = stack_top(vm, 1);
        {
            Node cls = node(vm, a);
            if (cls.kind != K_CLASS || b != EMPTY_ID || cls.sub >= N_CLASSES) return DECLINE;
            b = (uint32_t)field_count(cls.sub);
            if ((status = new_node(vm, K_OBJ, &id)) || (status = take(vm, b, &a))) return status;
            node_w(vm, id)->sub = cls.sub;
        }
        node_w(vm, id)->a = a;
        for (uint32_t k = 0; k < b; k++) pool_set(vm, (size_t)a + k, UNSET);
        vm->n_stack -= 2;
        return push(vm, id);
    case 'R': /* REDUCE */
        if (above_fence(vm) < 2) return DECLINE;
        a = stack_top(vm, 2), b = stack_top(vm, 1);
        vm->n_stack -= 2;
        return reduce(vm, a, b);
    case 'b': /* BUILD */
        if (above_fence(vm) < 2) return DECLINE;
        b = stack_top(vm, 1);
        vm->n_stack--;
        return build(vm, stack_top(vm, 1), b);
    case 0x93: /* STACK_GLOBAL */
        if (above_fence(vm) < 2) return DECLINE;
        a = stack_top(vm, 2), b = stack_top(vm, 1);
        vm->n_stack -= 2;
        return global(vm, a, b);
    case '.': /* STOP: the last byte, the stack holding the value alone */
        if (vm->pos != vm->size || vm->n_stack != 1 || vm->n_marks) return DECLINE;
        *done = 1;
        return 0;
    default:
        return DECLINE;
    }
}

/* --- the entries, from the decoded nodes ------------------------------------------------ */

typedef struct {
    PyObject *dtypes, *layout_problem, *component_of;
    Py_ssize_t slots[8]; /* where Entry keeps each field, in make_entry's order */
    PyTypeObject *chunk_info, *entry;
} Consts;

static PyObject *s_key, *s_kind, *s_dtype, *s_shape, *s_chunks, *s_nested_path, *s_component,
    *s_error, *s_tensor, *s_object, *s_other, *s_posix, *s_windows, *s_extra_state;

/* (string node, offsets node or UNSET) -> value node: the items in the order they were
 * added, found through an open-addressing index of their positions (small enough to stay
 * in cache; the items are read in about the order they were added). */
typedef struct {
    uint64_t hash;
    uint32_t key, offsets, value;
} Slot;

typedef struct {
    Slot *items;
    uint32_t *index;
    size_t n, cap, mask, next; /* next: the item after the one found last */
    Slot scratch;              /* what insert() gives past cap (a bug the check contains) */
} Table;

typedef struct {
    Vm *vm;
    const Consts *c;
    Table records, keys, planner;
    PyObject *sizes, *components; /* components: {(kind, first name, parts > 1): component} */
    PyObject *zeros[MAX_DIMS + 1]; /* the all-zero offsets of each length, made once */
    int has_planner;
    uint32_t *made; /* the string nodes whose str was made */
    size_t n_made, cap_made;
} Build;

/* STORAGE BEGIN */
/* Notes that string node `id` holds a str made for it (forget_all() releases them). */
static int
remember(Build *b, uint32_t id)
{
    if (grow((void **)&b->made, &b->cap_made, b->n_made + 1, sizeof(uint32_t))) return FAIL;
    b->made[b->n_made++] = id;
    return 0;
}

static void
forget_all(Build *b)
{
    for (size_t k = 0; k < b->n_made; k++) {
        uint32_t id = b->made[k];
        Py_DECREF((PyObject *)(intptr_t)node(b->vm, id).i);
        node_w(b->vm, id)->i = 0;
    }
    PyMem_Free(b->made);
}
/* STORAGE END */

static uint64_t
text_hash(Vm *vm, uint32_t id)
{
    size_t length, k = 0;
    const unsigned char *p = text_of(vm, node(vm, id), &length);
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ length, word;
    for (; k + 8 <= length; k += 8) {
        memcpy(&word, p + k, 8);
        h = (h ^ word) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 29;
    }
    for (; k < length; k++) h = (h ^ p[k]) * 0x100000001B3ULL;
    return h ^ h >> 32;
}

static uint64_t
ints_hash(Vm *vm, uint32_t id)
{
    if (id == UNSET) return 0x9E3779B97F4A7C15ULL;
    const Node t = node(vm, id);
    uint64_t h = 7;
    for (uint32_t k = 0; id != EMPTY_ID && k < t.b; k++)
        h = (h ^ (uint64_t)node(vm, pool_get(vm, (size_t)t.a + k)).i) * 0x100000001B3ULL + k;
    return h;
}

static int
same_string(Vm *vm, uint32_t x, uint32_t y)
{
    if (x == y) return 1;
    size_t n, m;
    const unsigned char *a = text_of(vm, node(vm, x), &n), *b = text_of(vm, node(vm, y), &m);
    return n == m && memcmp(a, b, n) == 0;
}

static uint32_t
length(Vm *vm, uint32_t tuple)
{
    return tuple == EMPTY_ID ? 0 : node(vm, tuple).b;
}

static int
same_ints(Vm *vm, uint32_t x, uint32_t y)
{
    if (x == UNSET || y == UNSET) return x == y;
    uint32_t n = length(vm, x);
    if (n != length(vm, y)) return 0;
    for (uint32_t k = 0; k < n; k++) {
        if (node(vm, pool_get(vm, (size_t)node(vm, x).a + k)).i != node(vm, pool_get(vm, (size_t)node(vm, y).a + k)).i)
            return 0;
    }
    return 1;
}

static int
table_init(Table *t, size_t count)
{
    size_t n = 16;
    while (n < 2 * count) n *= 2;
    t->items = PyMem_Malloc(sizeof(Slot) * (count ? count : 1));
    t->index = PyMem_Malloc(sizeof(uint32_t) * n);
    t->n = t->next = 0;
    t->cap = count ? count : 1;
    t->mask = n - 1;
    if (t->items == NULL || t->index == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    memset(t->index, 0xFF, sizeof(uint32_t) * n);
    return 0;
}

static uint64_t
slot_hash(Vm *vm, uint32_t key, uint32_t offsets)
{
    uint64_t h = text_hash(vm, key) ^ ints_hash(vm, offsets);
    h ^= h >> 33; /* mixed, so that offsets alike in their low bits spread over the index */
    h *= 0xFF51AFD7ED558CCDULL;
    return h ^ h >> 33;
}

/* The item holding (key, offsets), whose slot_hash is h, or NULL; *at: where in the index
 * it is, or would go. */
static Slot *
lookup(Vm *vm, const Table *t, uint64_t h, uint32_t key, uint32_t offsets, size_t *at)
{
    for (size_t k = (size_t)h & t->mask;; k = (k + 1) & t->mask) {
        uint32_t item = t->index[k];
        *at = k;
        if (item == UNSET) return NULL;
        Slot *s = &t->items[item];
        if (s->hash == h && same_string(vm, s->key, key) && same_ints(vm, s->offsets, offsets))
            return s;
    }
}

/* lookup(), trying first the item after the one found last: genuine files list keys, their
 * records and their paths in one order, so most are found without the index (exact all
 * the same: no two items hold the same key and offsets). */
static Slot *
find_next(Vm *vm, Table *t, uint32_t key, uint32_t offsets)
{
    Slot *s = t->next < t->n ? &t->items[t->next] : NULL;
    if (s == NULL || !same_string(vm, s->key, key) || !same_ints(vm, s->offsets, offsets)) {
        size_t at;
        s = lookup(vm, t, slot_hash(vm, key, offsets), key, offsets, &at);
    }
    if (s != NULL) t->next = (size_t)(s - t->items) + 1;
    return s;
}

/* The item holding (key, offsets); a new one (value UNSET) where there was none. At most as
 * many as table_init was given can be added. */
static Slot *
insert(Vm *vm, Table *t, uint32_t key, uint32_t offsets)
{
    size_t at;
    uint64_t h = slot_hash(vm, key, offsets);
    Slot *s = lookup(vm, t, h, key, offsets, &at);
    if (s != NULL) return s;
    if (t->n >= t->cap) {
        out_of_range(vm);
        t->scratch = (Slot){h, key, offsets, UNSET};
        return &t->scratch;
    }
    t->index[at] = (uint32_t)t->n;
    s = &t->items[t->n++];
    *s = (Slot){h, key, offsets, UNSET};
    return s;
}

/* The str of string node `id`, made once and kept in the node (NULL on an error, or with
 * no error set for a node that is no string). A borrowed reference. */
static PyObject *
text(Build *b, uint32_t id)
{
    Node n = node(b->vm, id);
    if (n.kind != K_STR) return NULL;
    if (n.i == 0) {
        size_t length;
        const unsigned char *p = text_of(b->vm, n, &length);
        PyObject *str = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)length, "surrogatepass");
        if (str == NULL) return NULL;
        if (remember(b, id)) {
            Py_DECREF(str);
            return NULL;
        }
        node_w(b->vm, id)->i = (int64_t)(intptr_t)str;
        return str;
    }
    return (PyObject *)(intptr_t)n.i;
}

static uint32_t
field(Vm *vm, uint32_t obj, int k)
{
    uint32_t value = pool_get(vm, (size_t)node(vm, obj).a + k);
    return value == UNSET ? NONE_ID : value;
}

static int
is_obj(Vm *vm, uint32_t id, int cls)
{
    return node(vm, id).kind == K_OBJ && node(vm, id).sub == cls;
}

static int
is_tuple(Vm *vm, uint32_t id)
{
    return id == EMPTY_ID || node(vm, id).kind == K_TUPLE;
}

/* Whether the tuple node holds only ints (in [0, MAX_INT) when `bounded`). */
static int
int_tuple(Vm *vm, uint32_t id, int bounded)
{
    if (!is_tuple(vm, id)) return 0;
    for (uint32_t k = 0; k < length(vm, id); k++) {
        const Node n = node(vm, pool_get(vm, (size_t)node(vm, id).a + k));
        if (n.kind != K_INT || (bounded && (n.i < 0 || n.i >= MAX_INT))) return 0;
    }
    return 1;
}

static PyObject *
ints(Vm *vm, uint32_t id)
{
    uint32_t n = length(vm, id);
    PyObject *t = PyTuple_New(n);
    for (uint32_t k = 0; t != NULL && k < n; k++) {
        PyObject *i = PyLong_FromLongLong(node(vm, pool_get(vm, (size_t)node(vm, id).a + k)).i);
        if (i == NULL) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, k, i);
    }
    return t;
}

/* Storage records by (fqn, offsets), each well-formed, none given twice; the files they
 * name into `names`. */
static int
index_records(Build *b, uint32_t table, PyObject *names)
{
    Vm *vm = b->vm;
    const Node d = node(vm, table);
    if (table_init(&b->records, d.b / 2)) return FAIL;
    for (uint32_t k = 0; k + 1 < d.b; k += 2) {
        uint32_t index = pool_get(vm, (size_t)d.a + k), info = pool_get(vm, (size_t)d.a + k + 1);
        if (!is_obj(vm, index, C_INDEX) || !is_obj(vm, info, C_STORAGE_INFO)) return DECLINE;
        uint32_t fqn = field(vm, index, 0), offsets = field(vm, index, 1);
        uint32_t file = field(vm, info, 0), transforms = field(vm, info, 3);
        if (node(vm, fqn).kind != K_STR || node(vm, file).kind != K_STR) return DECLINE;
        if (node(vm, field(vm, info, 1)).kind != K_INT || node(vm, field(vm, info, 2)).kind != K_INT)
            return DECLINE;
        if (offsets == NONE_ID) offsets = UNSET;
        else if (!int_tuple(vm, offsets, 0)) return DECLINE;
        if (transforms != NONE_ID) {
            uint8_t kind = node(vm, transforms).kind;
            if (!is_tuple(vm, transforms) && kind != K_LIST) return DECLINE;
            for (uint32_t t = 0; t < length(vm, transforms); t++) {
                if (node(vm, pool_get(vm, (size_t)node(vm, transforms).a + t)).kind != K_STR) return DECLINE;
            }
        }
        Slot *s = insert(vm, &b->records, fqn, offsets);
        if (s->value != UNSET) return DECLINE;
        s->value = info;
        PyObject *name = text(b, file);
        if (name == NULL || PySet_Add(names, name) < 0) return FAIL;
    }
    return 0;
}

static int
index_planner(Build *b, uint32_t planner)
{
    Vm *vm = b->vm;
    const Node d = node(vm, planner);
    if (table_init(&b->planner, d.b / 2)) return FAIL;
    for (uint32_t k = 0; k + 1 < d.b; k += 2) {
        uint32_t key = pool_get(vm, (size_t)d.a + k);
        if (node(vm, key).kind != K_STR) continue; /* never equal to a str key */
        uint32_t path = pool_get(vm, (size_t)d.a + k + 1);
        insert(vm, &b->planner, key, UNSET)->value = path; /* the last counts */
    }
    return 0;
}

/* reader._nested_path: a new tuple, DECLINE (NULL, no error) where Python would raise. */
static PyObject *
nested_path(Build *b, uint32_t key)
{
    Vm *vm = b->vm;
    PyObject *name = text(b, key);
    if (name == NULL) return NULL;
    if (!b->has_planner) return PyTuple_New(0);
    Slot *s = find_next(vm, &b->planner, key, UNSET);
    uint32_t path = s == NULL ? NONE_ID : s->value;
    const Node p = node(vm, path);
    if ((!is_tuple(vm, path) && p.kind != K_LIST) || length(vm, path) == 0)
        return PyTuple_Pack(1, name);
    if (p.b > MAX_PATH) return NULL;
    PyObject *out = PyTuple_New(p.b);
    for (uint32_t k = 0; out != NULL && k < p.b; k++) {
        uint32_t part = pool_get(vm, (size_t)p.a + k);
        const Node n = node(vm, part);
        PyObject *item = NULL;
        if (n.kind == K_STR) item = Py_XNewRef(text(b, part));
        else if (n.kind == K_INT && n.i >= 0 && n.i < MAX_PATH_INDEX)
            item = PyLong_FromLongLong(n.i);
        if (item == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, k, item);
    }
    return out;
}

/* The ChunkInfo of the chunk at `offsets` (sizes `csizes`) of `key`, from its storage record,
 * or NULL: DECLINE (no error) when there is none or it does not lie inside its file. */
static PyObject *
chunk(Build *b, uint32_t key, uint32_t offsets, PyObject *py_offsets, PyObject *py_sizes)
{
    Vm *vm = b->vm;
    Slot *s = find_next(vm, &b->records, key, offsets);
    if (s == NULL) return NULL;
    uint32_t info = s->value, transforms = field(vm, info, 3);
    int64_t start = node(vm, field(vm, info, 1)).i, n = node(vm, field(vm, info, 2)).i;
    PyObject *file = text(b, field(vm, info, 0)), *size, *result = NULL, *names = NULL;
    if (file == NULL || start < 0 || start >= MAX_INT || n < 0 || n >= MAX_INT) return NULL;
    size = PyDict_GetItemWithError(b->sizes, file);
    if (size == NULL || !PyLong_CheckExact(size)) return NULL;
    int overflow;
    long long bytes = PyLong_AsLongLongAndOverflow(size, &overflow);
    int64_t end;
    if (overflow || bytes < 0 || __builtin_add_overflow(start, n, &end) || end > bytes) return NULL;
    uint32_t count = transforms == NONE_ID ? 0 : length(vm, transforms);
    if ((names = PyTuple_New(count)) == NULL) return NULL;
    for (uint32_t k = 0; k < count; k++) {
        PyObject *t = text(b, pool_get(vm, (size_t)node(vm, transforms).a + k));
        if (t == NULL) goto done;
        PyTuple_SET_ITEM(names, k, Py_NewRef(t));
    }
    PyObject *items[6] = {py_offsets, py_sizes, file, PyLong_FromLongLong(start),
                          PyLong_FromLongLong(n), names};
    if (items[3] != NULL && items[4] != NULL
        && (result = b->c->chunk_info->tp_alloc(b->c->chunk_info, 6)) != NULL) {
        for (int k = 0; k < 6; k++) PyTuple_SET_ITEM(result, k, Py_NewRef(items[k]));
    }
    Py_XDECREF(items[3]);
    Py_XDECREF(items[4]);
done:
    Py_DECREF(names);
    return result;
}

typedef struct {
    int64_t start, size;
} Span;

static int
by_start(const void *a, const void *b)
{
    int64_t x = ((const Span *)a)->start, y = ((const Span *)b)->start;
    return (x > y) - (x < y);
}

static int64_t
item(Vm *vm, uint32_t tuple, uint32_t k)
{
    return node(vm, pool_get(vm, (size_t)node(vm, tuple).a + k)).i;
}

/* Whether the chunks (boxes[2i], boxes[2i + 1]: offsets and sizes, tuples of ndim ints in
 * range) are the whole tensor, or split it along one dimension into pieces that cover it end
 * to end (empty pieces anywhere inside), as dcp/_table.c's tiles(); -1 on an error. */
static int
tiles(Vm *vm, uint32_t shape, const uint32_t *boxes, size_t count)
{
    uint32_t ndim = length(vm, shape);
    int64_t dim = -1;
    for (size_t i = 0; i < count && dim < 0; i++) {
        for (uint32_t d = 0; d < ndim && dim < 0; d++) {
            if (item(vm, boxes[2 * i + 1], d) != item(vm, shape, d)) dim = d;
        }
    }
    if (dim < 0) { /* every chunk whole: one at the origin is the tensor, more repeat it */
        for (uint32_t d = 0; count == 1 && d < ndim; d++) {
            if (item(vm, boxes[0], d) != 0) return 0;
        }
        return count == 1;
    }
    Span few[FEW], *spans = count <= FEW ? few : PyMem_Malloc(sizeof(Span) * count);
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int fine = 1;
    for (size_t i = 0; i < count && fine; i++) {
        for (uint32_t d = 0; d < ndim && fine; d++) {
            int64_t at = item(vm, boxes[2 * i], d), size = item(vm, boxes[2 * i + 1], d);
            if (d == dim) spans[i] = (Span){at, size};
            else fine = at == 0 && size == item(vm, shape, d);
        }
    }
    if (fine) qsort(spans, count, sizeof(Span), by_start);
    int64_t end = 0, extent = item(vm, shape, (uint32_t)dim);
    for (size_t i = 0; i < count && fine; i++) {
        if (spans[i].size == 0) fine = spans[i].start <= extent;
        else if ((fine = spans[i].start == end && spans[i].size <= extent - end))
            end += spans[i].size;
    }
    if (spans != few) PyMem_Free(spans);
    return fine && end == extent;
}

/* make_entry(key, kind, dtype, shape, chunks, nested, component, None): the frozen record's
 * slots filled directly (what object.__setattr__ through each slot's descriptor does). */
static PyObject *
make_entry(const Consts *c, PyObject *values[7])
{
    PyObject *entry = c->entry->tp_alloc(c->entry, 0);
    if (entry == NULL) return NULL;
    for (int k = 0; k < 8; k++) {
        PyObject **slot = (PyObject **)((char *)entry + c->slots[k]);
        *slot = Py_NewRef(k < 7 ? values[k] : Py_None);
    }
    return entry;
}

/* Where Entry keeps each field (its __slots__' member descriptors), into c->slots. */
static int
entry_slots(Consts *c)
{
    PyObject *names[8] = {s_key, s_kind, s_dtype, s_shape, s_chunks, s_nested_path, s_component,
                          s_error};
    for (int k = 0; k < 8; k++) {
        PyObject *d = PyDict_GetItemWithError(c->entry->tp_dict, names[k]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)
            || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "consts: Entry needs slots");
            return FAIL;
        }
        c->slots[k] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    return 0;
}

/* The offsets (or sizes) of a chunk as a tuple: the shared zeros or the shape where they
 * are those (as most are), else a new one. NULL on an error. */
static PyObject *
dims_of(Build *b, uint32_t tuple, uint32_t shape, PyObject *py_shape)
{
    Vm *vm = b->vm;
    uint32_t n = length(vm, tuple), k = 0;
    if (same_ints(vm, tuple, shape)) return Py_NewRef(py_shape);
    while (k < n && item(vm, tuple, k) == 0) k++;
    if (k < n) return ints(vm, tuple);
    if (b->zeros[n] == NULL) b->zeros[n] = ints(vm, tuple);
    return Py_XNewRef(b->zeros[n]);
}

/* The tuple of a tensor key's ChunkInfos, with their tiling checked, or NULL (DECLINE when
 * no error is set). */
static PyObject *
tensor_chunks(Build *b, uint32_t key, uint32_t list, uint32_t shape, PyObject *py_shape)
{
    Vm *vm = b->vm;
    const Node l = node(vm, list);
    uint32_t ndim = length(vm, shape), few[2 * FEW];
    uint32_t *boxes = l.b <= FEW ? few : PyMem_Malloc(sizeof(uint32_t) * 2 * l.b);
    PyObject *found = boxes ? PyTuple_New(l.b) : PyErr_NoMemory();
    for (uint32_t k = 0; found != NULL && k < l.b; k++) {
        uint32_t record = pool_get(vm, (size_t)l.a + k), offsets, sizes;
        PyObject *o = NULL, *s = NULL, *one = NULL;
        if (is_obj(vm, record, C_CHUNK)) {
            offsets = field(vm, record, 0), sizes = field(vm, record, 1);
            if (int_tuple(vm, offsets, 1) && int_tuple(vm, sizes, 1) && length(vm, offsets) == ndim
                && length(vm, sizes) == ndim && (o = dims_of(b, offsets, shape, py_shape))
                && (s = dims_of(b, sizes, shape, py_shape)))
                one = chunk(b, key, offsets, o, s);
            boxes[2 * k] = offsets, boxes[2 * k + 1] = sizes;
        }
        Py_XDECREF(o);
        Py_XDECREF(s);
        if (one == NULL) Py_CLEAR(found);
        else PyTuple_SET_ITEM(found, k, one);
    }
    if (found != NULL) {
        int fine = tiles(vm, shape, boxes, l.b);
        if (fine == 0) { /* any other layout: entry.layout_problem decides */
            PyObject *problem = PyObject_CallFunctionObjArgs(b->c->layout_problem, py_shape, found,
                                                            NULL);
            fine = problem == NULL ? -1 : problem == Py_None;
            Py_XDECREF(problem);
        }
        if (fine != 1) Py_CLEAR(found);
    }
    if (boxes != few) PyMem_Free(boxes);
    return found;
}

static PyObject *
tensor_entry(Build *b, uint32_t key, uint32_t md, PyObject *nested, PyObject *component)
{
    Vm *vm = b->vm;
    uint32_t properties = field(vm, md, 0), shape = field(vm, md, 1), list = field(vm, md, 2);
    if (!is_obj(vm, properties, C_PROPERTIES)) return NULL;
    uint32_t dtype = field(vm, properties, 0);
    if (node(vm, dtype).kind != K_DTYPE || node(vm, list).kind != K_LIST || node(vm, list).sub)
        return NULL;
    if (!int_tuple(vm, shape, 1) || length(vm, shape) > MAX_DIMS) return NULL;
    int64_t numel = 1;
    for (uint32_t d = 0; d < length(vm, shape); d++) {
        int64_t n = item(vm, shape, d);
        if (n == 0) numel = 0;
        else if (numel && numel >= MAX_INT / n + (MAX_INT % n != 0)) return NULL;
        else numel *= n;
    }
    node_w(vm, list)->sub = 1; /* a list's sub: given to a key already */
    PyObject *name = text(b, (uint32_t)node(vm, dtype).i), *dtype_name, *py_shape, *found;
    if (name == NULL) return NULL;
    if ((dtype_name = PyDict_GetItemWithError(b->c->dtypes, name)) == NULL) return NULL;
    if ((py_shape = ints(vm, shape)) == NULL) return NULL;
    PyObject *result = NULL;
    if ((found = tensor_chunks(b, key, list, shape, py_shape)) != NULL) {
        PyObject *values[7] = {text(b, key), s_tensor, dtype_name, py_shape, found, nested,
                               component};
        result = make_entry(b->c, values);
        Py_DECREF(found);
    }
    Py_DECREF(py_shape);
    return result;
}

static PyObject *
object_entry(Build *b, uint32_t key, PyObject *nested, PyObject *component)
{
    PyObject *empty = PyTuple_New(0), *one, *found, *result = NULL;
    if (empty == NULL) return NULL;
    one = chunk(b, key, UNSET, empty, empty);
    Py_DECREF(empty);
    if (one == NULL) return NULL;
    found = PyTuple_Pack(1, one);
    Py_DECREF(one);
    if (found != NULL) {
        PyObject *values[7] = {text(b, key), s_object, Py_None, Py_None, found, nested,
                               component};
        result = make_entry(b->c, values);
        Py_DECREF(found);
    }
    return result;
}

/* components.component_of(kind, path), asked once per (kind, first name, parts > 1) where
 * no part can be extra state (it then depends on nothing else); "other" without a planner
 * (keys.components guesses those paths). A new reference, or NULL on an error. */
static PyObject *
component_of(Build *b, PyObject *kind, PyObject *path)
{
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    if (n == 0) return Py_NewRef(s_other);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *part = PyTuple_GET_ITEM(path, k);
        int extra = PyUnicode_CheckExact(part) ? PyUnicode_Contains(part, s_extra_state) : 1;
        if (extra < 0) return NULL;
        if (extra) return PyObject_CallFunctionObjArgs(b->c->component_of, kind, path, NULL);
    }
    PyObject *key = PyTuple_Pack(3, kind, n > 1 ? PyTuple_GET_ITEM(path, 0) : Py_None,
                                 n > 1 ? Py_True : Py_False);
    if (key == NULL) return NULL;
    PyObject *found = PyDict_GetItemWithError(b->components, key);
    if (found != NULL) {
        Py_DECREF(key);
        return Py_NewRef(found);
    }
    if (!PyErr_Occurred()
        && (found = PyObject_CallFunctionObjArgs(b->c->component_of, kind, path, NULL)) != NULL
        && PyDict_SetItem(b->components, key, found) < 0)
        Py_CLEAR(found);
    Py_DECREF(key);
    return found;
}

/* Every key's Entry into `out`, in table order; DECLINE at the first key Python must build. */
static int
all_entries(Build *b, uint32_t table, PyObject *out)
{
    Vm *vm = b->vm;
    const Node d = node(vm, table);
    if (table_init(&b->keys, d.b / 2)) return FAIL;
    for (uint32_t k = 0; k + 1 < d.b; k += 2) {
        uint32_t key = pool_get(vm, (size_t)d.a + k), md = pool_get(vm, (size_t)d.a + k + 1);
        if (node(vm, key).kind != K_STR) return DECLINE;
        Slot *s = insert(vm, &b->keys, key, UNSET);
        if (s->value != UNSET) return DECLINE;
        s->value = md;
        int tensor = is_obj(vm, md, C_TENSOR);
        if (!tensor && !is_obj(vm, md, C_BYTES)) return DECLINE;
        PyObject *nested = nested_path(b, key), *entry = NULL, *component;
        if (nested == NULL) return PyErr_Occurred() ? FAIL : DECLINE;
        component = component_of(b, tensor ? s_tensor : s_object, nested);
        if (component != NULL) {
            entry = tensor ? tensor_entry(b, key, md, nested, component)
                           : object_entry(b, key, nested, component);
            Py_DECREF(component);
        }
        Py_DECREF(nested);
        if (entry == NULL) return PyErr_Occurred() ? FAIL : DECLINE;
        int status = PyList_Append(out, entry);
        Py_DECREF(entry);
        if (status < 0) return FAIL;
    }
    return 0;
}

/* storage_meta.checkpoint_id: None, a str, or (kind, parts) for a path; NULL: DECLINE. */
static PyObject *
checkpoint_id(Build *b, uint32_t meta)
{
    Vm *vm = b->vm;
    if (meta == NONE_ID) Py_RETURN_NONE;
    if (!is_obj(vm, meta, C_STORAGE_META)) return NULL;
    uint32_t id = field(vm, meta, 0);
    const Node n = node(vm, id);
    if (id == NONE_ID) Py_RETURN_NONE;
    if (n.kind == K_STR) return Py_XNewRef(text(b, id));
    if (n.kind != K_PATH) return NULL;
    uint32_t count = length(vm, n.a);
    PyObject *parts = PyTuple_New(count);
    for (uint32_t k = 0; parts != NULL && k < count; k++) {
        PyObject *part = text(b, pool_get(vm, (size_t)node(vm, n.a).a + k));
        if (part == NULL) Py_CLEAR(parts);
        else PyTuple_SET_ITEM(parts, k, Py_NewRef(part));
    }
    if (parts == NULL) return NULL;
    PyObject *result = PyTuple_Pack(2, n.sub == F_POSIX ? s_posix : s_windows, parts);
    Py_DECREF(parts);
    return result;
}

static PyObject *
finish(Vm *vm, const Consts *c, PyObject *file_sizes, uint32_t root, int *status)
{
    Build b = {.vm = vm, .c = c};
    PyObject *names = NULL, *entries = NULL, *id = NULL, *result = NULL, *version;
    *status = DECLINE;
    if (!is_obj(vm, root, C_METADATA)) return NULL;
    uint32_t table = field(vm, root, 0), planner = field(vm, root, 1), storage = field(vm, root, 2);
    uint32_t meta = field(vm, root, 3), version_id = field(vm, root, 4);
    if (node(vm, table).kind != K_DICT || node(vm, storage).kind != K_DICT
        || field(vm, root, 5) != NONE_ID || (planner != NONE_ID && node(vm, planner).kind != K_DICT)
        || (version_id != NONE_ID && node(vm, version_id).kind != K_STR))
        return NULL;
    b.has_planner = planner != NONE_ID;
    if ((names = PySet_New(NULL)) == NULL || (entries = PyList_New(0)) == NULL
        || (b.components = PyDict_New()) == NULL)
        goto fail;
    if ((*status = index_records(&b, storage, names))) goto done;
    if (b.has_planner && (*status = index_planner(&b, planner))) goto done;
    if ((id = checkpoint_id(&b, meta)) == NULL) {
        *status = PyErr_Occurred() ? FAIL : DECLINE;
        goto done;
    }
    if ((b.sizes = PyObject_CallOneArg(file_sizes, names)) == NULL) goto fail;
    if (!PyDict_CheckExact(b.sizes)) {
        PyErr_SetString(PyExc_TypeError, "file_sizes must return a dict");
        goto fail;
    }
    if ((*status = all_entries(&b, table, entries))) goto done;
    version = version_id == NONE_ID ? Py_None : text(&b, version_id);
    if (version == NULL) goto fail;
    result = Py_BuildValue("(OOOO)", entries, b.has_planner ? Py_True : Py_False, version, id);
    if (result == NULL) goto fail;
    *status = 0;
    goto done;
fail:
    *status = FAIL;
done:
    forget_all(&b);
    Table *tables[3] = {&b.records, &b.keys, &b.planner};
    for (int k = 0; k < 3; k++) {
        PyMem_Free(tables[k]->items);
        PyMem_Free(tables[k]->index);
    }
    Py_XDECREF(b.sizes);
    Py_XDECREF(b.components);
    for (int k = 0; k <= MAX_DIMS; k++) Py_XDECREF(b.zeros[k]);
    Py_XDECREF(names);
    Py_XDECREF(entries);
    Py_XDECREF(id);
    return result;
}

static PyObject *
entries(PyObject *self, PyObject *args)
{
    Py_buffer data;
    PyObject *file_sizes, *consts, *result = NULL;
    Consts c;
    if (!PyArg_ParseTuple(args, "y*OO!:entries", &data, &file_sizes, &PyTuple_Type, &consts))
        return NULL;
    if (!PyArg_ParseTuple(consts, "O!O!O!OO:consts", &PyDict_Type, &c.dtypes, &PyType_Type,
                          &c.chunk_info, &PyType_Type, &c.entry, &c.layout_problem,
                          &c.component_of) || entry_slots(&c)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if ((size_t)data.len >= UNSET) { /* string offsets are 32-bit: the unpickler reads it */
        PyBuffer_Release(&data);
        Py_RETURN_NONE;
    }
    Vm vm = {0};
    vm.data = data.buf;
    vm.size = (size_t)data.len;
    vm.path_budget = 4LL * data.len + (1LL << 20); /* safe_pickle.budget's limit */
    vm.dtypes = c.dtypes;
    memset(vm.field_names, 0xFF, sizeof(vm.field_names));
    int status = reserve(&vm), done = 0;
    uint32_t id;
    for (int k = K_NONE; k <= K_FALSE && !status; k++) status = new_node(&vm, (uint8_t)k, &id);
    if (!status) status = new_node(&vm, K_TUPLE, &id);
    if (!status) status = new_node(&vm, K_LAYOUT, &id);
    for (int k = 0; k < SMALL_INTS && !status; k++) {
        if (!(status = new_node(&vm, K_INT, &id))) node_w(&vm, id)->i = k;
    }
    while (!status && !done) status = vm.pos < vm.size ? step(&vm, &done) : DECLINE;
    if (!status) result = finish(&vm, &c, file_sizes, stack_get(&vm, 0), &status);
    if (!status && vm.broken) { /* an index out of range: contained, and declined */
        Py_CLEAR(result);
        status = DECLINE;
    }
    release(&vm);
    PyBuffer_Release(&data);
    if (status == FAIL) {
        Py_XDECREF(result);
        return NULL;
    }
    return status == DECLINE ? Py_NewRef(Py_None) : result;
}

static PyMethodDef methods[] = {
    {"entries", entries, METH_VARARGS,
     "entries(data, file_sizes, consts) -> (entries, planner_data is a dict, version, "
     "checkpoint_id) | None: a sound DCP .metadata read straight into its entries; None for "
     "anything else (the caller unpickles it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_metadata", "DCP .metadata read straight into entries.", -1, methods,
};

PyMODINIT_FUNC
PyInit__metadata(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {
        {&s_key, "key"}, {&s_kind, "kind"}, {&s_dtype, "dtype"}, {&s_shape, "shape"},
        {&s_chunks, "chunks"}, {&s_nested_path, "nested_path"}, {&s_component, "component"},
        {&s_error, "error"}, {&s_tensor, "tensor"}, {&s_object, "object"}, {&s_other, "other"},
        {&s_posix, "posix"}, {&s_windows, "windows"}, {&s_extra_state, "_extra_state"},
    };
    for (size_t k = 0; k < sizeof(strings) / sizeof(strings[0]); k++) {
        if ((*strings[k].slot = PyUnicode_InternFromString(strings[k].text)) == NULL) return NULL;
    }
    return PyModule_Create(&definition);
}
