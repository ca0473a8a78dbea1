/* The entry table of a DCP .metadata, for the common case, at C speed (see reader.py).
 *
 * storage_by_key(storage_data) and shared_chunk_lists(table, TensorStorageMetadata) are
 * reader._storage_by_key and the key search of reader._shared_chunk_lists, line for line:
 * their results are exact, not fast paths.
 *
 * entries(table, by_key, sizes, planner, problems, consts) returns one item per key of
 * `table`, in its order: the finished Entry where the key is a plain tensor or object whose
 * records are all well-formed (exact ints in range, one StorageInfo per chunk inside its
 * file, the chunks tiling the shape), else None, and reader._entries builds that key's entry
 * in Python, which words the problem. So a None is never a verdict, and an Entry is only
 * ever given where Python would build the same one (tests/formats/test_dcp_table.py
 * compares the two on genuine and on mutated tables).
 *
 * consts: (TensorStorageMetadata, BytesStorageMetadata, StorageInfo, DtypeName,
 *          {known dtype name: name}, ChunkInfo, Entry, layout_problem).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>

#define MAX_DIMS 64
#define MAX_INT (1LL << 62)
#define MAX_PATH_INDEX (1LL << 20)
#define MAX_PATH 64

typedef struct {
    PyTypeObject *tensor_md, *bytes_md, *storage_info, *dtype_name, *chunk_info, *entry;
    PyObject *known_dtypes, *layout_problem;
} Consts;

static PyObject *s_fqn, *s_offset, *s_relative_path, *s_properties, *s_dtype, *s_size,
    *s_chunks, *s_offsets, *s_sizes, *s_length, *s_transforms, *s_tensor, *s_object, *s_other,
    *s_key, *s_kind, *s_shape, *s_nested_path, *s_component, *s_error, *empty_tuple;

/* getattr(obj, name, None): a new reference, or NULL on an error other than AttributeError. */
static PyObject *
optional_attr(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return value;
}

/* An exact int in [0, limit) into *out; 0 if it is not one (no error set). */
static int
small_int(PyObject *obj, long long limit, long long *out)
{
    int overflow;
    if (!PyLong_CheckExact(obj)) return 0;
    *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
    return !overflow && *out >= 0 && *out < limit;
}

/* reader._dims with a required length (ndim < 0: any up to MAX_DIMS): a new tuple, or NULL
 * (no error set) when `value` is not such a list or tuple of exact ints in range. */
static PyObject *
dims(PyObject *value, Py_ssize_t ndim)
{
    long long n;
    if (!PyTuple_CheckExact(value) && !PyList_CheckExact(value)) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(value);
    if (ndim >= 0 ? len != ndim : len > MAX_DIMS) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(value);
    for (Py_ssize_t i = 0; i < len; i++) {
        if (!small_int(items[i], MAX_INT, &n)) return NULL;
    }
    return PySequence_Tuple(value);
}

/* reader._nested_path: a new reference, or NULL (no error set) where Python would raise. */
static PyObject *
nested_path(PyObject *key, PyObject *planner)
{
    long long n;
    if (planner == Py_None) return Py_NewRef(empty_tuple);
    PyObject *path = PyDict_GetItemWithError(planner, key);
    if (path == NULL) return PyErr_Occurred() ? NULL : PyTuple_Pack(1, key);
    if (!PyTuple_Check(path) && !PyList_Check(path)) return PyTuple_Pack(1, key);
    if (!PyTuple_CheckExact(path) && !PyList_CheckExact(path)) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(path);
    if (len == 0) return PyTuple_Pack(1, key);
    if (len > MAX_PATH) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(path);
    for (Py_ssize_t i = 0; i < len; i++) {
        if (!PyUnicode_CheckExact(items[i]) && !small_int(items[i], MAX_PATH_INDEX, &n))
            return NULL;
    }
    return PySequence_Tuple(path);
}

/* reader._chunk and _chunk_problem for a StorageInfo that is well-formed and inside its
 * file: the ChunkInfo, or NULL (no error set) for anything else. */
static PyObject *
chunk(const Consts *c, PyObject *offsets, PyObject *sizes, PyObject *info, PyObject *file_sizes)
{
    long long start, length, size, end;
    if (Py_TYPE(info) != c->storage_info) return NULL;
    PyObject *fields[4] = {NULL, NULL, NULL, NULL}; /* path, offset, length, transforms */
    PyObject *names[4] = {s_relative_path, s_offset, s_length, s_transforms};
    PyObject *result = NULL, *transforms = NULL, *file_size;
    for (int i = 0; i < 4; i++) {
        if ((fields[i] = PyObject_GetAttr(info, names[i])) == NULL) goto done;
    }
    if (!PyUnicode_CheckExact(fields[0]) || !small_int(fields[1], MAX_INT, &start)
        || !small_int(fields[2], MAX_INT, &length))
        goto done;
    if (fields[3] == Py_None) {
        transforms = Py_NewRef(empty_tuple);
    } else if (PyTuple_CheckExact(fields[3]) || PyList_CheckExact(fields[3])) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(fields[3]);
        for (Py_ssize_t i = 0; i < len; i++) {
            if (!PyUnicode_CheckExact(PySequence_Fast_ITEMS(fields[3])[i])) goto done;
        }
        if ((transforms = PySequence_Tuple(fields[3])) == NULL) goto done;
    } else {
        goto done;
    }
    file_size = PyDict_GetItemWithError(file_sizes, fields[0]);
    if (file_size == NULL || !small_int(file_size, LLONG_MAX, &size)
        || __builtin_add_overflow(start, length, &end) || end > size)
        goto done;
    if ((result = c->chunk_info->tp_alloc(c->chunk_info, 6)) == NULL) goto done;
    PyObject *items[6] = {offsets, sizes, fields[0], fields[1], fields[2], transforms};
    for (int i = 0; i < 6; i++) PyTuple_SET_ITEM(result, i, Py_NewRef(items[i]));
done:
    Py_XDECREF(transforms);
    for (int i = 0; i < 4; i++) Py_XDECREF(fields[i]);
    return result;
}

/* make_entry(key, kind, dtype, shape, chunks, nested, "other", None), through the slots
 * (object.__setattr__, as entry.make_entry does: the dataclass is frozen). */
static PyObject *
make_entry(const Consts *c, PyObject *values[6])
{
    PyObject *names[8] = {s_key, s_kind, s_dtype, s_shape, s_chunks, s_nested_path, s_component,
                          s_error};
    PyObject *all[8] = {values[0], values[1], values[2], values[3], values[4], values[5],
                        s_other, Py_None};
    PyObject *entry = c->entry->tp_alloc(c->entry, 0);
    if (entry == NULL) return NULL;
    for (int i = 0; i < 8; i++) {
        if (PyObject_GenericSetAttr(entry, names[i], all[i]) < 0) {
            Py_DECREF(entry);
            return NULL;
        }
    }
    return entry;
}

/* Whether `found` is one chunk holding the whole tensor (entry.layout_problem's first case,
 * most keys: checked here without calling it); -1 on an error. */
static int
whole(PyObject *shape, PyObject *found)
{
    if (PyTuple_GET_SIZE(found) != 1) return 0;
    PyObject *only = PyTuple_GET_ITEM(found, 0), *offsets = PyTuple_GET_ITEM(only, 0);
    int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(only, 1), shape, Py_EQ);
    for (Py_ssize_t i = 0; same > 0 && i < PyTuple_GET_SIZE(offsets); i++) {
        same = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, i)) == 0;
    }
    return same;
}

typedef struct {
    long long start, size;
} Span;

static int
by_start(const void *a, const void *b)
{
    long long x = ((const Span *)a)->start, y = ((const Span *)b)->start;
    return (x > y) - (x < y);
}

/* Whether `found` (offsets and sizes checked to be ints in range) splits the tensor along
 * one dimension into pieces that cover it once: whole in every other dimension, and end to
 * end along that one (empty pieces anywhere inside). entry.layout_problem finds no problem
 * in such chunks; for any other layout it is called. -1 on an error. */
static int
tiles(PyObject *shape, PyObject *found)
{
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape), count = PyTuple_GET_SIZE(found), dim = -1;
    long long extent[MAX_DIMS];
    for (Py_ssize_t d = 0; d < ndim; d++) extent[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    for (Py_ssize_t i = 0; i < count && dim < 0; i++) {
        PyObject *one = PyTuple_GET_ITEM(found, i);
        for (Py_ssize_t d = 0; d < ndim && dim < 0; d++) {
            if (PyLong_AsLongLong(PyTuple_GET_ITEM(PyTuple_GET_ITEM(one, 1), d)) != extent[d])
                dim = d;
        }
    }
    if (dim < 0) return 0;
    Span *spans = PyMem_Malloc(sizeof(Span) * (size_t)(count ? count : 1));
    if (spans == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int fine = 1;
    for (Py_ssize_t i = 0; i < count && fine; i++) {
        PyObject *offsets = PyTuple_GET_ITEM(PyTuple_GET_ITEM(found, i), 0);
        PyObject *sizes = PyTuple_GET_ITEM(PyTuple_GET_ITEM(found, i), 1);
        for (Py_ssize_t d = 0; d < ndim && fine; d++) {
            long long at = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, d));
            long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, d));
            if (d == dim) spans[i] = (Span){at, size};
            else fine = at == 0 && size == extent[d];
        }
    }
    if (fine) qsort(spans, (size_t)count, sizeof(Span), by_start);
    long long end = 0;
    for (Py_ssize_t i = 0; i < count && fine; i++) {
        if (spans[i].size == 0) fine = spans[i].start <= extent[dim];
        else if ((fine = spans[i].start == end && spans[i].size <= extent[dim] - end))
            end += spans[i].size;
    }
    PyMem_Free(spans);
    return fine && end == extent[dim];
}

/* The Entry of a well-formed tensor key, or NULL (no error set, or an error to clear). */
static PyObject *
tensor_entry(const Consts *c, PyObject *key, PyObject *md, PyObject *where, PyObject *sizes,
             PyObject *nested)
{
    PyObject *properties = NULL, *dtype = NULL, *size = NULL, *shape = NULL, *list = NULL;
    PyObject *found = NULL, *result = NULL, *name;
    long long numel = 1;
    if ((properties = optional_attr(md, s_properties)) == NULL) goto done;
    if ((dtype = optional_attr(properties, s_dtype)) == NULL) goto done;
    if (Py_TYPE(dtype) != c->dtype_name) goto done;
    if ((name = PyDict_GetItemWithError(c->known_dtypes, dtype)) == NULL) goto done;
    if ((size = PyObject_GetAttr(md, s_size)) == NULL || (shape = dims(size, -1)) == NULL)
        goto done;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t i = 0; i < ndim; i++) {
        long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (n == 0) numel = 0;
        else if (numel && numel >= MAX_INT / n + (MAX_INT % n != 0)) goto done;
        else numel *= n;
    }
    if ((list = PyObject_GetAttr(md, s_chunks)) == NULL || !PyList_CheckExact(list)) goto done;
    Py_ssize_t count = PyList_GET_SIZE(list);
    if ((found = PyTuple_New(count)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *record = PyList_GET_ITEM(list, i), *offsets_attr, *sizes_attr;
        PyObject *offsets = NULL, *csizes = NULL, *info, *one = NULL;
        if ((offsets_attr = optional_attr(record, s_offsets)) == NULL) goto done;
        if ((sizes_attr = optional_attr(record, s_sizes)) == NULL) {
            Py_DECREF(offsets_attr);
            goto done;
        }
        offsets = dims(offsets_attr, ndim);
        csizes = offsets ? dims(sizes_attr, ndim) : NULL;
        Py_DECREF(offsets_attr);
        Py_DECREF(sizes_attr);
        info = csizes ? PyDict_GetItemWithError(where, offsets) : NULL;
        if (info != NULL) one = chunk(c, offsets, csizes, info, sizes);
        Py_XDECREF(offsets);
        Py_XDECREF(csizes);
        if (one == NULL) goto done;
        PyTuple_SET_ITEM(found, i, one);
    }
    int fine = whole(shape, found);
    if (fine == 0) fine = tiles(shape, found);
    if (fine < 0) goto done;
    if (!fine) {
        PyObject *problem = PyObject_CallFunctionObjArgs(c->layout_problem, shape, found, NULL);
        if (problem == NULL) goto done;
        fine = problem == Py_None;
        Py_DECREF(problem);
    }
    if (fine) {
        PyObject *values[6] = {key, s_tensor, name, shape, found, nested};
        result = make_entry(c, values);
    }
done:
    Py_XDECREF(properties);
    Py_XDECREF(dtype);
    Py_XDECREF(size);
    Py_XDECREF(shape);
    Py_XDECREF(list);
    Py_XDECREF(found);
    return result;
}

/* The Entry of an object key whose one record (offsets None) is well-formed, or NULL. */
static PyObject *
object_entry(const Consts *c, PyObject *key, PyObject *where, PyObject *sizes, PyObject *nested)
{
    PyObject *info = PyDict_GetItemWithError(where, Py_None), *one, *found, *result;
    if (info == NULL || (one = chunk(c, empty_tuple, empty_tuple, info, sizes)) == NULL)
        return NULL;
    found = PyTuple_Pack(1, one);
    Py_DECREF(one);
    if (found == NULL) return NULL;
    PyObject *values[6] = {key, s_object, Py_None, Py_None, found, nested};
    result = make_entry(c, values);
    Py_DECREF(found);
    return result;
}

/* One key's Entry, or None for Python to build; NULL only on an error to propagate. */
static PyObject *
row(const Consts *c, PyObject *key, PyObject *md, PyObject *by_key, PyObject *sizes,
    PyObject *planner, PyObject *problems, PyObject *no_records)
{
    PyObject *where, *nested, *entry = NULL;
    int known;
    if (!PyUnicode_CheckExact(key)) Py_RETURN_NONE;
    if ((known = PyDict_Contains(problems, key)) != 0) return known < 0 ? NULL : Py_NewRef(Py_None);
    where = PyDict_GetItemWithError(by_key, key);
    if (where == NULL && PyErr_Occurred()) return NULL;
    if (where == NULL) where = no_records;
    if ((nested = nested_path(key, planner)) != NULL) {
        if (Py_TYPE(md) == c->tensor_md) entry = tensor_entry(c, key, md, where, sizes, nested);
        else if (Py_TYPE(md) == c->bytes_md) entry = object_entry(c, key, where, sizes, nested);
        Py_DECREF(nested);
    }
    if (entry != NULL) return entry;
    /* Declined: Python builds this key, and raises what it must; C keeps only fatal errors. */
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
            return NULL;
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static int
parse_consts(PyObject *tuple, Consts *c)
{
    PyObject *types[6];
    if (!PyArg_ParseTuple(tuple, "O!O!O!O!O!O!O!O:consts", &PyType_Type, &types[0], &PyType_Type,
                          &types[1], &PyType_Type, &types[2], &PyType_Type, &types[3],
                          &PyDict_Type, &c->known_dtypes, &PyType_Type, &types[4], &PyType_Type,
                          &types[5], &c->layout_problem))
        return 0;
    c->tensor_md = (PyTypeObject *)types[0];
    c->bytes_md = (PyTypeObject *)types[1];
    c->storage_info = (PyTypeObject *)types[2];
    c->dtype_name = (PyTypeObject *)types[3];
    c->chunk_info = (PyTypeObject *)types[4];
    c->entry = (PyTypeObject *)types[5];
    if (!PyType_IsSubtype(c->chunk_info, &PyTuple_Type) || c->chunk_info->tp_itemsize == 0) {
        PyErr_SetString(PyExc_TypeError, "consts: ChunkInfo must be a tuple type");
        return 0;
    }
    return 1;
}

static PyObject *
entries(PyObject *self, PyObject *args)
{
    PyObject *table, *by_key, *sizes, *planner, *problems, *consts_tuple, *key, *md;
    Consts c;
    Py_ssize_t pos = 0, i = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!:entries", &PyDict_Type, &table, &PyDict_Type,
                          &by_key, &PyDict_Type, &sizes, &planner, &PyDict_Type, &problems,
                          &PyTuple_Type, &consts_tuple))
        return NULL;
    if (planner != Py_None && !PyDict_CheckExact(planner)) {
        PyErr_SetString(PyExc_TypeError, "entries: planner must be a dict or None");
        return NULL;
    }
    if (!parse_consts(consts_tuple, &c)) return NULL;
    PyObject *no_records = PyDict_New(), *result = PyList_New(PyDict_GET_SIZE(table));
    if (no_records == NULL || result == NULL) goto fail;
    while (PyDict_Next(table, &pos, &key, &md)) {
        if (i >= PyList_GET_SIZE(result)) {
            PyErr_SetString(PyExc_RuntimeError, "entries: the table changed size");
            goto fail;
        }
        PyObject *one = row(&c, key, md, by_key, sizes, planner, problems, no_records);
        if (one == NULL) goto fail;
        PyList_SET_ITEM(result, i++, one);
    }
    Py_DECREF(no_records);
    return result;
fail:
    Py_XDECREF(no_records);
    Py_XDECREF(result);
    return NULL;
}

/* by_key[fqn][None or tuple(offset)] = info, as reader._storage_by_key builds it. */
static int
add_record(PyObject *by_key, PyObject *names, PyObject *index, PyObject *info)
{
    PyObject *fqn = NULL, *offset = NULL, *place = NULL, *name = NULL, *per;
    int status = -1;
    if ((fqn = optional_attr(index, s_fqn)) == NULL) goto done;
    if ((offset = optional_attr(index, s_offset)) == NULL) goto done;
    if (!PyUnicode_Check(fqn)) {
        status = 0;
        goto done;
    }
    if ((per = PyDict_GetItemWithError(by_key, fqn)) == NULL) {
        if (PyErr_Occurred() || (per = PyDict_New()) == NULL) goto done;
        int set = PyDict_SetItem(by_key, fqn, per);
        Py_DECREF(per);
        if (set < 0) goto done;
    }
    place = offset == Py_None ? Py_NewRef(Py_None) : PySequence_Tuple(offset);
    if (place == NULL || PyDict_SetItem(per, place, info) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            status = 0;
        }
        goto done;
    }
    if ((name = optional_attr(info, s_relative_path)) == NULL) goto done;
    status = PyUnicode_Check(name) ? PySet_Add(names, name) : 0;
done:
    Py_XDECREF(fqn);
    Py_XDECREF(offset);
    Py_XDECREF(place);
    Py_XDECREF(name);
    return status;
}

static PyObject *
storage_by_key(PyObject *self, PyObject *arg)
{
    PyObject *index, *info, *by_key, *names;
    Py_ssize_t pos = 0;
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "storage_by_key: storage_data must be a dict");
        return NULL;
    }
    by_key = PyDict_New();
    names = PySet_New(NULL);
    if (by_key == NULL || names == NULL) goto fail;
    Py_INCREF(arg); /* the records are borrowed while Python code (a hash) may run */
    while (PyDict_Next(arg, &pos, &index, &info)) {
        Py_INCREF(index);
        Py_INCREF(info);
        int status = add_record(by_key, names, index, info);
        Py_DECREF(index);
        Py_DECREF(info);
        if (status < 0) {
            Py_DECREF(arg);
            goto fail;
        }
    }
    Py_DECREF(arg);
    PyObject *pair = PyTuple_Pack(2, by_key, names);
    Py_DECREF(by_key);
    Py_DECREF(names);
    return pair;
fail:
    Py_XDECREF(by_key);
    Py_XDECREF(names);
    return NULL;
}

/* reader._shared_chunk_lists: {key: the first key with the same chunk list object}. */
static PyObject *
shared_chunk_lists(PyObject *self, PyObject *args)
{
    PyObject *table, *tensor_md, *key, *md, *owners, *found = NULL;
    Py_ssize_t pos = 0;
    if (!PyArg_ParseTuple(args, "O!O!:shared_chunk_lists", &PyDict_Type, &table, &PyType_Type,
                          &tensor_md))
        return NULL;
    if ((owners = PyDict_New()) == NULL || (found = PyDict_New()) == NULL) goto fail;
    while (PyDict_Next(table, &pos, &key, &md)) {
        if (!PyObject_TypeCheck(md, (PyTypeObject *)tensor_md)) continue;
        PyObject *chunks = PyObject_GetAttr(md, s_chunks), *id, *first;
        if (chunks == NULL) goto fail;
        int is_list = PyList_Check(chunks);
        id = is_list ? PyLong_FromVoidPtr(chunks) : NULL;
        Py_DECREF(chunks); /* the table keeps the list alive, and with it its id */
        if (!is_list) continue;
        if (id == NULL) goto fail;
        first = PyDict_SetDefault(owners, id, key);
        Py_DECREF(id);
        if (first == NULL || (first != key && PyDict_SetItem(found, key, first) < 0)) goto fail;
    }
    Py_DECREF(owners);
    return found;
fail:
    Py_XDECREF(owners);
    Py_XDECREF(found);
    return NULL;
}

typedef struct {
    long long file, start, end;
} Range;

static int
by_place(const void *a, const void *b)
{
    const Range *x = a, *y = b;
    if (x->file != y->file) return (x->file > y->file) - (x->file < y->file);
    return (x->start > y->start) - (x->start < y->start);
}

/* STORAGE BEGIN: the one growable array here (see _metadata.c's rules) */
typedef struct {
    Range *items;
    Py_ssize_t used, room;
} Ranges;

/* Appends `one` (a copy: no pointer into the array is handed out); -1 out of memory. */
static int
add_range(Ranges *r, Range one)
{
    if (r->used == r->room) {
        Py_ssize_t room = r->room ? 2 * r->room : 1024;
        Range *more = PyMem_Realloc(r->items, sizeof(Range) * (size_t)room);
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->items = more;
        r->room = room;
    }
    r->items[r->used++] = one;
    return 0;
}

static void
drop_ranges(Ranges *r)
{
    PyMem_Free(r->items);
}

/* Whether no two ranges of one file overlap (sorts them). */
static int
disjoint(Ranges *r)
{
    if (r->used > 1) qsort(r->items, (size_t)r->used, sizeof(Range), by_place);
    /* Sorted by start, and none overlapping so far: the previous range ends furthest. */
    for (Py_ssize_t k = 1; k < r->used; k++) {
        const Range x = r->items[k - 1], y = r->items[k];
        if (x.file == y.file && y.start < x.end) return 0;
    }
    return 1;
}
/* STORAGE END */


/* Whether one sound chunk (a 6-field ChunkInfo of ints) of a tensor or object holds room
 * for its elements; its byte range goes to `ranges`. 1 fits, 0 does not, -1 undecided. */
static int
chunk_fits(PyObject *chunk, int tensor, PyObject *safetensors, long long ratio, PyObject *files,
           Range *range)
{
    long long elements = 1, room, start, length;
    int overflow;
    if (!PyTuple_Check(chunk) || PyTuple_GET_SIZE(chunk) != 6) return -1;
    PyObject *sizes = PyTuple_GET_ITEM(chunk, 1), *file = PyTuple_GET_ITEM(chunk, 2);
    start = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(chunk, 3), &overflow);
    if (overflow || (start == -1 && PyErr_Occurred())) return -1;
    length = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(chunk, 4), &overflow);
    if (overflow || (length == -1 && PyErr_Occurred()) || start < 0 || length < 0
        || !PyUnicode_CheckExact(file) || !PyTuple_Check(sizes))
        return -1;
    PyObject *id = PyDict_GetItemWithError(files, file);
    if (id == NULL) {
        if (PyErr_Occurred() || (id = PyLong_FromSsize_t(PyDict_GET_SIZE(files))) == NULL)
            return -1;
        int set = PyDict_SetItem(files, file, id);
        Py_DECREF(id);
        if (set < 0) return -1;
    }
    *range = (Range){PyLong_AsLongLong(id), start, 0};
    if (__builtin_add_overflow(start, length, &range->end)) return -1;
    int in_file = PySet_Contains(safetensors, file);
    if (in_file < 0) return -1;
    if (!tensor || in_file) return 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(sizes); d++) {
        long long n = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(sizes, d), &overflow);
        if (overflow || n < 0 || (n == -1 && PyErr_Occurred())
            || __builtin_mul_overflow(elements, n, &elements))
            return -1;
    }
    if (!PyTuple_Check(PyTuple_GET_ITEM(chunk, 5))) return -1;
    long long scale = PyTuple_GET_SIZE(PyTuple_GET_ITEM(chunk, 5)) ? 8 * ratio : 8;
    if (__builtin_mul_overflow(length, scale, &room)) return 1;
    return elements <= room;
}

/* reader._check_items's verdict where it is plain: True when no entry without an error has
 * an item too small for its elements or sharing bytes with another (the entries then stand
 * as they are); False or None (a record it does not follow) when Python must look. */
static PyObject *
items_fit(PyObject *self, PyObject *args)
{
    PyObject *entries, *safetensors, *files = NULL, *verdict = NULL;
    long long ratio;
    Ranges ranges = {NULL, 0, 0};
    int fits = 1;
    if (!PyArg_ParseTuple(args, "O!OL:items_fit", &PyList_Type, &entries, &safetensors, &ratio))
        return NULL;
    if (!PyAnySet_Check(safetensors) || ratio < 1 || ratio > (1 << 20)) {
        PyErr_SetString(PyExc_TypeError, "items_fit: needs a set of names and a ratio");
        return NULL;
    }
    if ((files = PyDict_New()) == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries) && fits == 1; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i), *error, *kind, *chunks;
        if ((error = PyObject_GetAttr(entry, s_error)) == NULL) goto done;
        int skip = PyObject_IsTrue(error);
        Py_DECREF(error);
        if (skip < 0) goto done;
        if (skip) continue;
        if ((kind = PyObject_GetAttr(entry, s_kind)) == NULL) goto done;
        int tensor = PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "tensor") == 0;
        Py_DECREF(kind);
        if ((chunks = PyObject_GetAttr(entry, s_chunks)) == NULL) goto done;
        if (!PyTuple_Check(chunks)) fits = -1;
        for (Py_ssize_t k = 0; fits == 1 && k < PyTuple_GET_SIZE(chunks); k++) {
            Range one;
            fits = chunk_fits(PyTuple_GET_ITEM(chunks, k), tensor, safetensors, ratio, files,
                              &one);
            if (fits == 1 && one.end > one.start && add_range(&ranges, one) < 0) {
                Py_DECREF(chunks);
                goto done;
            }
        }
        Py_DECREF(chunks);
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
            goto done;
        PyErr_Clear(); /* a record it does not follow: Python looks */
        fits = -1;
    }
    if (fits == 1) fits = disjoint(&ranges);
    verdict = fits < 0 ? Py_NewRef(Py_None) : PyBool_FromLong(fits);
done:
    Py_XDECREF(files);
    drop_ranges(&ranges);
    return verdict;
}

static PyMethodDef methods[] = {
    {"items_fit", items_fit, METH_VARARGS,
     "items_fit(entries, safetensors, zstd_ratio) -> bool | None: True when no item is too "
     "small or overlaps another (reader._check_items would change nothing)."},
    {"shared_chunk_lists", shared_chunk_lists, METH_VARARGS,
     "shared_chunk_lists(table, TensorStorageMetadata) -> {key: first key}: keys whose chunk "
     "list is an earlier key's."},
    {"storage_by_key", storage_by_key, METH_O,
     "storage_by_key(storage_data) -> (by_key, names): reader._storage_by_key in C."},
    {"entries", entries, METH_VARARGS,
     "entries(table, by_key, sizes, planner, problems, consts) -> list[Entry | None]: each "
     "key's entry where its records are well-formed, None where Python must build it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_table", "The DCP entry table's fast path.", -1, methods,
};

PyMODINIT_FUNC
PyInit__table(void)
{
    struct { PyObject **slot; const char *text; } strings[] = {
        {&s_fqn, "fqn"}, {&s_offset, "offset"}, {&s_relative_path, "relative_path"},
        {&s_properties, "properties"}, {&s_dtype, "dtype"}, {&s_size, "size"},
        {&s_chunks, "chunks"}, {&s_offsets, "offsets"}, {&s_sizes, "sizes"},
        {&s_length, "length"}, {&s_transforms, "transform_descriptors"}, {&s_tensor, "tensor"},
        {&s_object, "object"}, {&s_other, "other"}, {&s_key, "key"}, {&s_kind, "kind"},
        {&s_shape, "shape"}, {&s_nested_path, "nested_path"}, {&s_component, "component"},
        {&s_error, "error"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        if ((*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL) return NULL;
    }
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    return PyModule_Create(&definition);
}
