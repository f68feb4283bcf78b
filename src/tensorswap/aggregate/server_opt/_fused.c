/* Fused server-optimizer steps: one pass over a tensor instead of a dozen ufunc passes.
 *
 * Each function performs, per element, exactly the IEEE float32 (or float64) operations of
 * the numpy kernels in kernels.py, in the same order, each rounded to the array's type: no
 * fused multiply-add (built with -ffp-contract=off) and no fast-math, so the results are bit
 * for bit those of the numpy path. Only the memory traffic changes: every array is read or
 * written once, in one loop. The GIL is released while the loop runs.
 *
 * Arrays arrive through the buffer protocol (numpy arrays, memoryviews): C-contiguous, of
 * one item size (4 or 8 bytes, float32 or float64, checked by the format), one length; the
 * state and `out` writable. Python checks dtypes and shapes before it calls here; the checks
 * here keep a wrong call from touching memory it does not own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "widths.h"

enum { ADAM = 0, YOGI = 1, ADAGRAD = 2 };
enum { NBUF = 5 };

#define ADAPTIVE_LOOP(T, SQRT)                                                              \
    WIDTHS static void adaptive_##T(int rule, Py_ssize_t n, const T *restrict cur,                  \
                             const T *restrict agg, T *restrict m, T *restrict v,           \
                             T *restrict out, T b1, T a1, T b2, T a2, T eta, T tau) {       \
        Py_ssize_t i;                                                                       \
        if (rule == ADAM) {                                                                 \
            for (i = 0; i < n; i++) {                                                       \
                T d = agg[i] - cur[i];                                                      \
                T mm = m[i] * b1;                                                           \
                T t = d * a1;                                                               \
                mm = mm + t;                                                                \
                T d2 = d * d;                                                               \
                d2 = d2 * a2;                                                               \
                T vv = v[i] * b2;                                                           \
                vv = vv + d2;                                                               \
                T s = SQRT(vv);                                                             \
                s = s + tau;                                                                \
                T q = mm * eta;                                                             \
                q = q / s;                                                                  \
                m[i] = mm;                                                                  \
                v[i] = vv;                                                                  \
                out[i] = cur[i] + q;                                                        \
            }                                                                               \
        } else if (rule == YOGI) {                                                          \
            for (i = 0; i < n; i++) {                                                       \
                T d = agg[i] - cur[i];                                                      \
                T mm = m[i] * b1;                                                           \
                T t = d * a1;                                                               \
                mm = mm + t;                                                                \
                T d2 = d * d;                                                               \
                T vv = v[i];                                                                \
                T g = vv - d2;                                                              \
                /* numpy's sign: -1, +0 (also for -0) or 1, and NaN stays NaN */            \
                g = g > (T)0 ? (T)1 : (g < (T)0 ? (T)-1 : (g == (T)0 ? (T)0 : g));          \
                g = g * d2;                                                                 \
                g = g * a2;                                                                 \
                vv = vv - g;                                                                \
                T s = SQRT(vv);                                                             \
                s = s + tau;                                                                \
                T q = mm * eta;                                                             \
                q = q / s;                                                                  \
                m[i] = mm;                                                                  \
                v[i] = vv;                                                                  \
                out[i] = cur[i] + q;                                                        \
            }                                                                               \
        } else { /* ADAGRAD: no m; the numerator is d itself */                             \
            for (i = 0; i < n; i++) {                                                       \
                T d = agg[i] - cur[i];                                                      \
                T vv = v[i] + d * d;                                                        \
                T s = SQRT(vv);                                                             \
                s = s + tau;                                                                \
                T q = d * eta;                                                              \
                q = q / s;                                                                  \
                v[i] = vv;                                                                  \
                out[i] = cur[i] + q;                                                        \
            }                                                                               \
        }                                                                                   \
    }

ADAPTIVE_LOOP(float, sqrtf)
ADAPTIVE_LOOP(double, sqrt)

static void release(Py_buffer *views, int count) {
    for (int k = 0; k < count; k++) PyBuffer_Release(&views[k]);
}

/* adaptive(rule, cur, agg, m, v, out, b1, a1, b2, a2, eta, tau): m is ignored for ADAGRAD
 * (pass v again). Scalars are Python floats, rounded to the arrays' type here, as numpy
 * rounds its float32 scalars. */
static PyObject *fused_adaptive(PyObject *self, PyObject *args) {
    int rule;
    PyObject *objs[NBUF];
    double b1, a1, b2, a2, eta, tau;
    if (!PyArg_ParseTuple(args, "iOOOOOdddddd", &rule, &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &b1, &a1, &b2, &a2, &eta, &tau))
        return NULL;
    if (rule != ADAM && rule != YOGI && rule != ADAGRAD) {
        PyErr_Format(PyExc_ValueError, "unknown rule %d", rule);
        return NULL;
    }
    Py_buffer views[NBUF];
    int got = 0;
    for (; got < NBUF; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= 2 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[got], &views[got], flags) < 0) {
            release(views, got);
            return NULL;
        }
    }
    const char *fmt = views[0].format ? views[0].format : "B";
    Py_ssize_t item = views[0].itemsize;
    int is32 = strcmp(fmt, "f") == 0 && item == 4, is64 = strcmp(fmt, "d") == 0 && item == 8;
    if (!is32 && !is64) {
        release(views, NBUF);
        PyErr_Format(PyExc_TypeError, "arrays must be float32 or float64, not format '%s'", fmt);
        return NULL;
    }
    for (int k = 1; k < NBUF; k++) {
        const char *f = views[k].format ? views[k].format : "B";
        if (strcmp(f, fmt) != 0 || views[k].itemsize != item || views[k].len != views[0].len) {
            release(views, NBUF);
            PyErr_SetString(PyExc_ValueError, "arrays must share one dtype and one length");
            return NULL;
        }
    }
    /* The loops are compiled with `restrict`: the written buffers (m, v, out) must not overlap
     * each other or the inputs. FedAdagrad passes v for the m it does not use. */
    for (int w = 2; w < NBUF; w++) {
        for (int k = 0; k < NBUF; k++) {
            if (k == w || (rule == ADAGRAD && ((w == 2 && k == 3) || (w == 3 && k == 2))))
                continue;
            const char *a = views[w].buf, *b = views[k].buf;
            if (views[0].len > 0 && a < b + views[k].len && b < a + views[w].len) {
                release(views, NBUF);
                PyErr_SetString(PyExc_ValueError, "the state and out must not overlap any array");
                return NULL;
            }
        }
    }
    Py_ssize_t n = views[0].len / item;
    Py_BEGIN_ALLOW_THREADS
    if (is32)
        adaptive_float(rule, n, views[0].buf, views[1].buf, views[2].buf, views[3].buf,
                       views[4].buf, (float)b1, (float)a1, (float)b2, (float)a2, (float)eta,
                       (float)tau);
    else
        adaptive_double(rule, n, views[0].buf, views[1].buf, views[2].buf, views[3].buf,
                        views[4].buf, b1, a1, b2, a2, eta, tau);
    Py_END_ALLOW_THREADS
    release(views, NBUF);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"adaptive", fused_adaptive, METH_VARARGS,
     "adaptive(rule, cur, agg, m, v, out, b1, a1, b2, a2, eta, tau): one fused pass of "
     "FedAdam (0), FedYogi (1) or FedAdagrad (2) over flat float32/float64 buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused",
    "Fused one-pass server-optimizer kernels (bit-identical to the numpy kernels).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddIntConstant(mod, "ADAM", ADAM) < 0 ||
        PyModule_AddIntConstant(mod, "YOGI", YOGI) < 0 ||
        PyModule_AddIntConstant(mod, "ADAGRAD", ADAGRAD) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
