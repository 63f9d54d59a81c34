/* The index's calls on int64 id arrays: engine block ids checked (ids.c), and a job's end by the
 * slots the index gave it (index.c, ix_complete_slots / ix_release_slots). */
#include <string.h>

#include "binding.h"

/* A 1-D C-contiguous int64 buffer; -1 with ValueError (MemoryError as it is) if not. */
static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) return -1;
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "expected slots as a contiguous int64 array");
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(f, "l") && strcmp(f, "q"))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "expected slots as a 1-D int64 array");
        return -1;
    }
    return 0;
}

PyObject *ix_bind_complete_slots(IndexObject *self, PyObject *args) {
    PyObject *obj;
    int success;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Op", &obj, &success) || int64_view(obj, &view) < 0) return NULL;
    ix_refusal why = {0, -1};
    int64_t n = view.len / 8;
    ix_status st = ix_complete_slots(&self->ix, view.buf, n, success, &why);
    PyBuffer_Release(&view);
    return st != IX_OK ? ix_bind_fail(st, &why) : PyLong_FromLongLong(n);
}

PyObject *ix_bind_release_slots(IndexObject *self, PyObject *obj) {
    Py_buffer view;
    if (int64_view(obj, &view) < 0) return NULL;
    ix_refusal why = {0, -1};
    int64_t n = view.len / 8;
    ix_status st = ix_release_slots(&self->ix, view.buf, n, &why);
    PyBuffer_Release(&view);
    return st != IX_OK ? ix_bind_fail(st, &why) : PyLong_FromLongLong(n);
}

/* ids(obj, upper, distinct): ``obj`` (a list or tuple of exact ints, or a 1-D C-contiguous int64
 * buffer) as int64 ``bytes`` when every id is in [0, upper) (upper < 0: >= 0 only) and, with
 * ``distinct``, none repeats; None for anything else (the caller's checks then say what). */
PyObject *ix_bind_ids(PyObject *self, PyObject *args) {
    PyObject *obj;
    long long upper;
    int want_distinct;
    if (!PyArg_ParseTuple(args, "OLp", &obj, &upper, &want_distinct)) return NULL;
    Py_buffer view;
    int has_view = 0;
    Py_ssize_t n;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        n = PySequence_Fast_GET_SIZE(obj);
    } else if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        has_view = 1;
        const char *f = view.format ? view.format : "B";
        if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
        if (view.ndim != 1 || view.itemsize != 8 || (strcmp(f, "l") && strcmp(f, "q"))) {
            PyBuffer_Release(&view);
            Py_RETURN_NONE;
        }
        n = view.len / 8;
    } else {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) {
        if (has_view) PyBuffer_Release(&view);
        return NULL;
    }
    int64_t *v = (int64_t *)PyBytes_AS_STRING(out);
    int ok = 1;
    if (has_view) {
        memcpy(v, view.buf, (size_t)n * 8);
        PyBuffer_Release(&view);
    } else {
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            int overflow = 0;
            ok = PyLong_CheckExact(items[i]);
            if (ok) v[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            ok = ok && !overflow;
        }
    }
    if (ok) ok = ix_ids_fit(v, n, upper, want_distinct);
    if (ok > 0) return out;
    Py_DECREF(out);
    if (ok < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
