/* The opcode pre-scan of prescan.py, for the common case, at C speed.
 *
 * clean(data, start, limit, table) walks the pickle at byte `start` of `data` opcode by
 * opcode, as prescan._claimed_sizes does, and returns True only when that walk would find
 * a well-formed pickle (it reaches STOP) in which no LONG_BINPUT index and no FRAME length
 * exceeds `limit` and no frame starts inside another. Anything else (a PUT, whose index is
 * text that Python's int() parses, an unknown opcode, a claim too large, the data ending)
 * returns False, and the caller runs the Python scan, which says exactly what is wrong.
 * So a False is never a verdict, and a True is only ever given where Python's scan would
 * accept the pickle.
 *
 * `table` holds one byte per opcode, built from pickletools by prescan.py: the kind in the
 * high nibble, the argument's size (fixed) or length width (counted) in the low one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

enum {
    UNKNOWN = 0,
    FIXED = 1,       /* n argument bytes */
    COUNTED = 2,     /* an n-byte little-endian length, then that many bytes */
    LINE = 3,        /* one newline-terminated argument */
    TWO_LINES = 4,   /* GLOBAL, INST */
    PUT = 5,         /* a text memo index: left to Python */
    LONG_BINPUT = 6, /* a 4-byte memo index, checked against the limit */
    FRAME = 7,       /* an 8-byte frame length, checked against the limit */
    STOP = 8,
};

static unsigned long long
little_endian(const unsigned char *p, int width)
{
    unsigned long long value = 0;
    for (int k = width - 1; k >= 0; k--) {
        value = (value << 8) | p[k];
    }
    return value;
}

static int
walk(const unsigned char *data, Py_ssize_t end, Py_ssize_t i, unsigned long long limit,
     const unsigned char *table)
{
    Py_ssize_t frame_end = 0;
    while (i < end) {
        unsigned char op = data[i];
        int kind = table[op] >> 4, n = table[op] & 15;
        Py_ssize_t left = end - i - 1; /* bytes after the opcode */
        unsigned long long claimed;
        const unsigned char *line;
        switch (kind) {
        case STOP:
            return 1;
        case FIXED:
            if (left < n) return 0;
            i += 1 + n;
            break;
        case LONG_BINPUT:
        case FRAME:
            if (left < n) return 0;
            claimed = little_endian(data + i + 1, n);
            if (claimed > limit) return 0;
            if (kind == FRAME) {
                if (i < frame_end) return 0;
                /* claimed <= limit <= the data's length (clean() checks): no overflow, and
                 * the sum is checked all the same */
                if (__builtin_add_overflow(i + 1 + n, (Py_ssize_t)claimed, &frame_end)) return 0;
            }
            i += 1 + n;
            break;
        case COUNTED:
            if (left < n) return 0;
            claimed = little_endian(data + i + 1, n);
            if (claimed > (unsigned long long)(left - n)) return 0;
            i += 1 + n + (Py_ssize_t)claimed;
            break;
        case LINE:
        case TWO_LINES:
            line = memchr(data + i + 1, '\n', (size_t)left);
            if (line == NULL) return 0;
            i = (line - data) + 1;
            if (kind == TWO_LINES) {
                line = memchr(data + i, '\n', (size_t)(end - i));
                if (line == NULL) return 0;
                i = (line - data) + 1;
            }
            break;
        default: /* UNKNOWN, PUT */
            return 0;
        }
    }
    return 0;
}

static PyObject *
clean(PyObject *module, PyObject *args)
{
    Py_buffer data, table;
    Py_ssize_t start;
    unsigned long long limit;
    int found;
    if (!PyArg_ParseTuple(args, "y*nKy*", &data, &start, &limit, &table)) return NULL;
    if (table.len != 256 || start < 0 || start > data.len
        || limit > (unsigned long long)(data.len - start)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError,
                        "clean() needs a 256-byte table, a start inside data and a limit no "
                        "larger than the data after it");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    found = walk(data.buf, data.len, start, limit, table.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&table);
    return PyBool_FromLong(found);
}

static PyMethodDef methods[] = {
    {"clean", clean, METH_VARARGS,
     "clean(data, start, limit, table) -> bool: whether the pickle at data[start:] is "
     "well-formed with no memo index or frame length above limit (False: scan in Python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_opscan", "The pickle opcode pre-scan's fast path.", -1, methods,
};

PyMODINIT_FUNC
PyInit__opscan(void)
{
    return PyModule_Create(&definition);
}
