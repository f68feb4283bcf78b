/* SecAgg+'s stochastic quantization in one pass (quantize.py's numpy loop, fused).
 *
 * Per element, exactly the operations of Quantizer.quantize's numpy path, in the same order
 * and precision: the clip in float32 (numpy clips a float32 array by Python floats in
 * float32), then float64 for the rest: z = clip(x) * scale; u = word * 2^-32 + offset;
 * z = floor(z + u), clamped to [0, levels], stored as uint32. No fused multiply-add (built
 * with -ffp-contract=off), no fast-math: the words come out bit for bit those of the numpy
 * path. Only the memory traffic changes (no float64 temporaries). The GIL is released while
 * the loop runs.
 *
 * quantize(x, words, out, lo, hi, scale, offset, levels): x float32, words and out uint32
 * (the buffer protocol: C-contiguous, format checked), one length; out writable and apart
 * from both inputs. Python checks finiteness and the parameters before it calls here; the
 * checks here keep a wrong call from touching memory it does not own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "widths.h"

WIDTHS static void quantize_loop(Py_ssize_t n, const float *restrict x,
                                 const uint32_t *restrict words, uint32_t *restrict out,
                                 float lo, float hi, double scale, double offset,
                                 double levels) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float c = x[i];
        c = c > lo ? c : lo; /* numpy: minimum(maximum(x, lo), hi) */
        c = c < hi ? c : hi;
        double z = (double)c * scale;
        double u = (double)words[i] * 0x1p-32;
        u = u + offset;
        z = z + u;
        z = floor(z);
        z = z > 0.0 ? z : 0.0;
        z = z < levels ? z : levels;
        out[i] = (uint32_t)z;
    }
}

static int is_format(const Py_buffer *view, const char *const *names, Py_ssize_t item) {
    const char *fmt = view->format ? view->format : "B";
    if (view->itemsize != item) return 0;
    for (; *names != NULL; names++)
        if (strcmp(fmt, *names) == 0) return 1;
    return 0;
}

static const char *const FLOAT32[] = {"f", "<f", "=f", NULL};
/* uint32 as numpy names it on this platform ("I"; "L" where long is 4 bytes) */
static const char *const UINT32[] = {"I", "<I", "=I", "L", "<L", "=L", NULL};

static PyObject *quantize(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    double lo, hi, scale, offset, levels;
    if (!PyArg_ParseTuple(args, "OOOddddd", &objs[0], &objs[1], &objs[2], &lo, &hi, &scale,
                          &offset, &levels))
        return NULL;
    Py_buffer views[3];
    int got = 0;
    for (; got < 3; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got == 2 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[got], &views[got], flags) < 0) break;
    }
    const char *error = NULL;
    PyObject *kind = PyExc_TypeError;
    if (got < 3) {
        for (int k = 0; k < got; k++) PyBuffer_Release(&views[k]);
        return NULL;
    }
    if (!is_format(&views[0], FLOAT32, 4)) {
        error = "x must be float32";
    } else if (!is_format(&views[1], UINT32, 4) || !is_format(&views[2], UINT32, 4)) {
        error = "words and out must be uint32";
    } else if (views[1].len != views[0].len || views[2].len != views[0].len) {
        error = "x, words and out must have one length";
        kind = PyExc_ValueError;
    } else {
        const char *o = views[2].buf;
        for (int k = 0; k < 2 && error == NULL; k++) {
            const char *b = views[k].buf;
            if (views[0].len > 0 && o < b + views[k].len && b < o + views[2].len) {
                error = "out must not overlap x or words";
                kind = PyExc_ValueError;
            }
        }
    }
    if (error == NULL && !(levels >= 0.0 && levels <= 4294967295.0)) {
        error = "levels must be in 0..2^32-1";
        kind = PyExc_ValueError;
    }
    if (error != NULL) {
        for (int k = 0; k < 3; k++) PyBuffer_Release(&views[k]);
        PyErr_SetString(kind, error);
        return NULL;
    }
    Py_ssize_t n = views[0].len / 4;
    Py_BEGIN_ALLOW_THREADS
    quantize_loop(n, views[0].buf, views[1].buf, views[2].buf, (float)lo, (float)hi, scale,
                  offset, levels);
    Py_END_ALLOW_THREADS
    for (int k = 0; k < 3; k++) PyBuffer_Release(&views[k]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(x, words, out, lo, hi, scale, offset, levels): SecAgg+'s stochastic rounding "
     "of float32 x into uint32 out, one fused pass (bit-identical to the numpy path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_quantize",
    "SecAgg+'s stochastic quantization in one pass (bit-identical to the numpy path).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__quantize(void) { return PyModule_Create(&module); }
