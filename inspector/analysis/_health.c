/* Health's numbers for one block of float32 values, taken 256 KiB at a time while that part
 * is in cache (see health_pass.py, whose torch code is the same arithmetic where this module
 * is not built).
 *
 * weights(block, n, kept, update, start, mode, width, rows, first_row, columns)
 *   block: the block's values (n float32); kept / update: the parameter's carried values and
 *   last update (float32, the block lies at [start, start + n)); mode 0: kept holds nothing
 *   yet (the block is only copied in), 1: kept holds the step before, 2: and update the
 *   update before. A non-finite value counts as NaN or Inf and as 0 in every number; an
 *   update's non-finite values are 0. rows / columns (or None): each row's and column's max
 *   |w| of a matrix `width` wide whose block starts at row `first_row`.
 *   Returns (squares, nan, inf, zeros, absmax, update_squares, update_dot); kept and update
 *   are overwritten with the block and its update.
 * moments(m, v, n, eps, with_step)
 *   exp_avg's and exp_avg_sq's first n values: (m squares, v squares, v zeros, squares of
 *   m / (sqrt(v) + eps) in float32, or 0.0 without with_step), over finite values.
 * Sums are float64: a float32 square never overflows one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A float32 view of `obj` (a buffer) holding at least `need` values: 0, or -1 with an error. */
static int
floats(PyObject *obj, Py_ssize_t need, int writable, Py_buffer *view, const char *what)
{
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->len / 4 < need || (need && (uintptr_t)view->buf % sizeof(float))) {
        PyErr_Format(PyExc_ValueError, "%s: %zd aligned float32 values needed, %zd bytes given",
                     what, need, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Whether n floats at a and at b share memory (the loops below take them as restrict). */
static int
overlap(const float *a, const float *b, Py_ssize_t n)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b, size = (uintptr_t)n * sizeof(float);
    return n > 0 && x < y + size && y < x + size;
}

#define SUB_BLOCK (1 << 16) /* values per pass: 256 KiB, in a core's L2 cache */
#define LANES 8 /* independent sums, so that the compiler keeps them in vector registers */
/* The loops also built for AVX2, picked at load time where the CPU has it: the same sums (the
 * lanes fix their order; no FMA contraction), twice the width. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

typedef struct {
    double squares, update_squares, update_dot;
    long long nan, inf, zeros;
    float absmax;
} Tally;

static inline float
finite_or_zero(float x)
{
    return fabsf(x) <= FLT_MAX ? x : 0.0f;
}

static double
lanes_sum(const double *lanes)
{
    double sum = 0.0;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    return sum;
}

/* Squares and zeros of x[0..n) as they are (a non-finite sum: some value is not finite). */
WIDE static void
squares_and_zeros(const float *restrict x, Py_ssize_t n, Tally *t)
{
    double squares[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) squares[j] += (double)x[i + j] * x[i + j];
    for (; i < n; i++) squares[0] += (double)x[i] * x[i];
    long long zeros = 0;
    for (i = 0; i < n; i++) zeros += x[i] == 0.0f;
    t->squares = lanes_sum(squares);
    t->zeros = zeros;
}

/* The same numbers where some value is not finite: NaN and Inf counted, then taken as 0. */
static void
squares_and_zeros_of_finite(const float *x, Py_ssize_t n, Tally *t)
{
    double squares = 0.0;
    t->zeros = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        t->nan += isnan(x[i]) != 0;
        t->inf += isinf(x[i]) != 0;
        float w = finite_or_zero(x[i]);
        squares += (double)w * w;
        t->zeros += w == 0.0f;
    }
    t->squares = squares;
}

/* |x| as ordered bits: for values without NaN, max of these is the bits of max |x| (an
 * integer max, which vectorizes where a float one, for NaN's sake, does not). */
static inline int32_t
magnitude_bits(float x)
{
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & 0x7fffffff;
}

static inline float
from_bits(int32_t bits)
{
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Each row's and column's max |w| of the matrix x (n / width rows), or its max in absmax;
 * `finite`: x holds no NaN or Inf (else they count as 0). */
WIDE static void
maxima(const float *restrict x, Py_ssize_t n, Py_ssize_t width, float *restrict rows,
       float *restrict columns, int finite, Tally *t)
{
    if (!finite) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float a = fabsf(finite_or_zero(x[i]));
            if (rows) {
                Py_ssize_t r = i / width, c = i % width;
                rows[r] = a > rows[r] ? a : rows[r];
                columns[c] = a > columns[c] ? a : columns[c];
            }
            else {
                t->absmax = a > t->absmax ? a : t->absmax;
            }
        }
        return;
    }
    if (!rows) {
        int32_t top = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t b = magnitude_bits(x[i]);
            top = b > top ? b : top;
        }
        t->absmax = from_bits(top) > t->absmax ? from_bits(top) : t->absmax;
        return;
    }
    for (Py_ssize_t r = 0; r < n / width; r++) {
        const float *row = x + r * width;
        int32_t top = 0;
        for (Py_ssize_t c = 0; c < width; c++) {
            int32_t b = magnitude_bits(row[c]);
            top = b > top ? b : top;
        }
        for (Py_ssize_t c = 0; c < width; c++) {
            float a = fabsf(row[c]);
            columns[c] = a > columns[c] ? a : columns[c];
        }
        rows[r] = from_bits(top) > rows[r] ? from_bits(top) : rows[r];
    }
}

/* update = block - kept (non-finite: 0), its squares and its dot with the update before;
 * kept = block. */
WIDE static void
tally_update(const float *restrict x, float *restrict kept, float *restrict update, Py_ssize_t n, int dot, Tally *t)
{
    double squares[LANES] = {0}, product[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float now = finite_or_zero(x[i + j] - kept[i + j]);
            squares[j] += (double)now * now;
            product[j] += (double)now * update[i + j];
            update[i + j] = now;
            kept[i + j] = x[i + j];
        }
    for (; i < n; i++) {
        float now = finite_or_zero(x[i] - kept[i]);
        squares[0] += (double)now * now;
        product[0] += (double)now * update[i];
        update[i] = now;
        kept[i] = x[i];
    }
    t->update_squares = lanes_sum(squares);
    t->update_dot = dot ? lanes_sum(product) : 0.0;
}

/* Every number of the block x (n values), SUB_BLOCK values (whole rows) at a time, so that
 * each part stays in cache through its passes. */
static void
tally_block(const float *x, Py_ssize_t n, Py_ssize_t width, float *rows, float *columns,
            float *kept, float *update, int mode, Tally *t)
{
    Py_ssize_t rows_per_part = SUB_BLOCK / width > 0 ? SUB_BLOCK / width : 1;
    Py_ssize_t step = rows ? rows_per_part * width : SUB_BLOCK;
    for (Py_ssize_t at = 0; at < n; at += step) {
        Py_ssize_t size = n - at < step ? n - at : step;
        Tally part = {0};
        squares_and_zeros(x + at, size, &part);
        int finite = isfinite(part.squares);
        if (!finite) squares_and_zeros_of_finite(x + at, size, &part);
        maxima(x + at, size, width, rows ? rows + at / width : NULL, columns, finite, &part);
        if (mode > 0)
            tally_update(x + at, kept + at, update + at, size, mode == 2, &part);
        else
            memcpy(kept + at, x + at, (size_t)size * sizeof(float));
        t->squares += part.squares;
        t->nan += part.nan;
        t->inf += part.inf;
        t->zeros += part.zeros;
        t->absmax = part.absmax > t->absmax ? part.absmax : t->absmax;
        t->update_squares += part.update_squares;
        t->update_dot += part.update_dot;
    }
}

typedef struct {
    double m_squares, v_squares, step_squares;
    long long v_zeros;
} Moments;

/* Squares of m, of v and of m / (sqrt(v) + eps) as they are, and v's zeros. */
WIDE static void
moment_sums(const float *restrict m, const float *restrict v, Py_ssize_t n, float eps, Moments *out)
{
    double m_sq[LANES] = {0}, v_sq[LANES] = {0}, step_sq[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float s = m[i + j] / (sqrtf(v[i + j]) + eps);
            m_sq[j] += (double)m[i + j] * m[i + j];
            v_sq[j] += (double)v[i + j] * v[i + j];
            step_sq[j] += (double)s * s;
        }
    for (; i < n; i++) {
        float s = m[i] / (sqrtf(v[i]) + eps);
        m_sq[0] += (double)m[i] * m[i];
        v_sq[0] += (double)v[i] * v[i];
        step_sq[0] += (double)s * s;
    }
    long long zeros = 0;
    for (i = 0; i < n; i++) zeros += v[i] == 0.0f;
    *out = (Moments){lanes_sum(m_sq), lanes_sum(v_sq), lanes_sum(step_sq), zeros};
}

/* The same sums over finite values only (some value or step is not finite). */
static void
moment_sums_of_finite(const float *m, const float *v, Py_ssize_t n, float eps, Moments *out)
{
    double m_sq = 0.0, v_sq = 0.0, step_sq = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        float a = finite_or_zero(m[i]), b = finite_or_zero(v[i]);
        float s = finite_or_zero(m[i] / (sqrtf(v[i]) + eps));
        m_sq += (double)a * a;
        v_sq += (double)b * b;
        step_sq += (double)s * s;
    }
    out->m_squares = m_sq;
    out->v_squares = v_sq;
    out->step_squares = step_sq;
}

static PyObject *
weights(PyObject *self, PyObject *args)
{
    PyObject *block_obj, *kept_obj, *update_obj, *rows_obj, *columns_obj;
    Py_ssize_t n, start, width, first_row;
    int mode;
    Tally t = {0};
    if (!PyArg_ParseTuple(args, "OnOOninOnO", &block_obj, &n, &kept_obj, &update_obj, &start,
                          &mode, &width, &rows_obj, &first_row, &columns_obj))
        return NULL;
    if (n < 0 || start < 0 || width < 1 || first_row < 0 || mode < 0 || mode > 2 ||
        n % width || start > PY_SSIZE_T_MAX - n) {
        PyErr_SetString(PyExc_ValueError, "weights: a size out of range");
        return NULL;
    }
    int matrix = rows_obj != Py_None;
    if (matrix != (columns_obj != Py_None) || (mode > 0) != (update_obj != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "weights: rows and columns, update and mode disagree");
        return NULL;
    }
    Py_buffer block, kept, update = {0}, rows = {0}, columns = {0};
    if (floats(block_obj, n, 0, &block, "block") < 0) return NULL;
    if (floats(kept_obj, start + n, 1, &kept, "kept") < 0) goto fail_block;
    if (mode > 0 && floats(update_obj, start + n, 1, &update, "update") < 0) goto fail_kept;
    if (matrix) {
        if (first_row > PY_SSIZE_T_MAX - n / width) {
            PyErr_SetString(PyExc_ValueError, "weights: first_row out of range");
            goto fail_update;
        }
        if (floats(rows_obj, first_row + n / width, 1, &rows, "rows") < 0) goto fail_update;
        if (floats(columns_obj, width, 1, &columns, "columns") < 0) goto fail_rows;
    }
    const float *x = block.buf;
    float *kept_at = (float *)kept.buf + start;
    float *update_at = mode > 0 ? (float *)update.buf + start : NULL;
    if (overlap(x, kept_at, n) || (update_at && (overlap(x, update_at, n) ||
                                                 overlap(kept_at, update_at, n)))) {
        PyErr_SetString(PyExc_ValueError, "weights: block, kept and update overlap");
        goto fail_all;
    }
    Py_BEGIN_ALLOW_THREADS
    tally_block(x, n, width, matrix ? (float *)rows.buf + first_row : NULL,
                matrix ? columns.buf : NULL, kept_at, update_at, mode, &t);
    Py_END_ALLOW_THREADS
fail_all:
    if (matrix) PyBuffer_Release(&columns);
fail_rows:
    if (matrix) PyBuffer_Release(&rows);
fail_update:
    if (mode > 0) PyBuffer_Release(&update);
fail_kept:
    PyBuffer_Release(&kept);
fail_block:
    PyBuffer_Release(&block);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("dLLLddd", t.squares, t.nan, t.inf, t.zeros, (double)t.absmax,
                         t.update_squares, t.update_dot);
}

static PyObject *
moments(PyObject *self, PyObject *args)
{
    PyObject *m_obj, *v_obj;
    Py_ssize_t n;
    double eps;
    int with_step;
    if (!PyArg_ParseTuple(args, "OOndp", &m_obj, &v_obj, &n, &eps, &with_step)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "moments: a negative count");
        return NULL;
    }
    Py_buffer m, v;
    if (floats(m_obj, n, 0, &m, "exp_avg") < 0) return NULL;
    if (floats(v_obj, n, 0, &v, "exp_avg_sq") < 0) {
        PyBuffer_Release(&m);
        return NULL;
    }
    Moments sums = {0};
    float e = with_step ? (float)eps : 1.0f; /* no step wanted: one that stays finite */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t at = 0; at < n; at += SUB_BLOCK) {
        Py_ssize_t size = n - at < SUB_BLOCK ? n - at : SUB_BLOCK;
        const float *a = (const float *)m.buf + at, *b = (const float *)v.buf + at;
        Moments part;
        moment_sums(a, b, size, e, &part);
        if (!isfinite(part.m_squares + part.v_squares + part.step_squares))
            moment_sums_of_finite(a, b, size, e, &part);
        sums.m_squares += part.m_squares;
        sums.v_squares += part.v_squares;
        sums.step_squares += part.step_squares;
        sums.v_zeros += part.v_zeros;
    }
    Py_END_ALLOW_THREADS
    if (!with_step) sums.step_squares = 0.0;
    PyBuffer_Release(&m);
    PyBuffer_Release(&v);
    return Py_BuildValue("ddLd", sums.m_squares, sums.v_squares, sums.v_zeros, sums.step_squares);
}

static PyMethodDef methods[] = {
    {"weights", weights, METH_VARARGS, "One block's weight numbers (see the module's comment)."},
    {"moments", moments, METH_VARARGS, "One block's Adam-moment numbers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_health", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__health(void)
{
    return PyModule_Create(&module);
}
