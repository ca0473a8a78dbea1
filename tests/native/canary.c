/* A deliberate use-after-free through PyMem_Realloc, the shape of the bug issue 34 found:
 * test_sanitized.py builds it like the extensions and expects the sanitized process to stop
 * at it, which shows the harness sees such reads (PYTHONMALLOC=malloc, ASan preloaded). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
stale_read(PyObject *self, PyObject *args)
{
    (void)self, (void)args;
    char *items = PyMem_Malloc(64);
    if (items == NULL) return PyErr_NoMemory();
    const char *kept = &items[8]; /* a pointer kept across the growth */
    char *bigger = PyMem_Realloc(items, 1 << 16);
    if (bigger == NULL) return PyErr_NoMemory();
    long value = *(volatile const char *)kept;
    PyMem_Free(bigger);
    return PyLong_FromLong(value);
}

static PyMethodDef methods[] = {{"stale_read", stale_read, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, "canary", NULL, -1, methods};

PyMODINIT_FUNC
PyInit_canary(void)
{
    return PyModule_Create(&definition);
}
