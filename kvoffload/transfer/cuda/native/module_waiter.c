/* kvoffload.transfer.cuda._core.Waiter: a load job's per-layer wait as one C call (binding.h).
 *
 * An engine calls its waiter once per layer, between the layers' launches. There the CPU's
 * caches hold the engine's code and data, not ours, and every line our call touches is a miss:
 * a Python closure around Job.wait_on read 2.4-4.1 us a call in bench e2e against 0.22 us in a
 * loop (benchmarks/wait_cold_probe.py measures the same on the CPU). The waiter is one C call
 * with everything resolved at its creation: the layers' slices, the stream, the timeout, the
 * timer. A layer whose slice this stream already waits for returns at once; a landed slice
 * returns with the GIL held (kvo_job_landed); otherwise the wait is enqueued as Job.wait_on
 * does (GIL released). Bad input and failures go through Python callables given at creation,
 * so the messages are the Python code's (kvoffload/transfer/cuda/staged.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "binding.h"

typedef struct {
    PyObject_HEAD
    JobObject *job;     /* holds its core */
    PyObject *timer;    /* a Timer of the same core, or NULL */
    kvo_timer *timed;   /* its timer, or NULL */
    PyObject *check;    /* check(layer, layers): raises ValueError for a bad layer */
    PyObject *fail;     /* fail(): raises the job's error */
    unsigned long long stream;
    double timeout;
    int64_t layers;     /* the bound a layer is checked against; -1: unchecked */
    int64_t n_owner;
    int64_t *owner;     /* per layer, its slice */
    int64_t waited;     /* the slice this stream waits for already; -1: none */
} WaiterObject;

static void waiter_dealloc(WaiterObject *self) {
    Py_XDECREF(self->job);
    Py_XDECREF(self->timer);
    Py_XDECREF(self->check);
    Py_XDECREF(self->fail);
    free(self->owner);
    PyObject_Free(self);
}

/* The layer of a call's one argument, checked as the Python waiter checks it; -1 with an
 * exception set when it is refused. *exact: an int in [0, layers) taken without a check call. */
static int layer_of(WaiterObject *self, PyObject *arg, long long *layer) {
    if (PyLong_CheckExact(arg)) {
        int overflow = 0;
        *layer = PyLong_AsLongLongAndOverflow(arg, &overflow);
        if (!overflow && (self->layers < 0 || (*layer >= 0 && *layer < self->layers))) return 0;
    }
    if (self->layers >= 0) { /* refused here: Python says why (or lets an int subclass pass) */
        PyObject *r = PyObject_CallFunction(self->check, "OL", arg, (long long)self->layers);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    *layer = PyLong_AsLongLong(arg);
    return *layer == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *waiter_call(WaiterObject *self, PyObject *args, PyObject *kwargs) {
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args) != 1) {
        PyErr_Format(PyExc_TypeError, "a layer waiter takes one argument (the layer), got %zd",
                     PyTuple_GET_SIZE(args) + (kwargs ? PyDict_GET_SIZE(kwargs) : 0));
        return NULL;
    }
    PyObject *arg = PyTuple_GET_ITEM(args, 0);
    long long layer = 0;
    if (layer_of(self, arg, &layer) < 0) return NULL;
    int64_t k = PyLong_CheckExact(arg) && layer >= 0 && layer < self->n_owner ? self->owner[layer]
                                                                               : -1;
    if (k >= 0 && k == self->waited) Py_RETURN_NONE; /* a slice's words are written together */
    int ok;
    if (kvo_job_enqueue_wait(self->job, self->stream, layer, self->timeout, self->timed, &ok) < 0)
        return NULL;
    if (!ok) {
        PyObject *r = PyObject_CallNoArgs(self->fail);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        PyErr_SetString(PyExc_RuntimeError, "the transfer failed");
        return NULL;
    }
    self->waited = k;
    Py_RETURN_NONE;
}

PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._core.Waiter",
    .tp_basicsize = sizeof(WaiterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "waiter(layer): a load's wait for one layer, on the stream it was made for",
    .tp_dealloc = (destructor)waiter_dealloc,
    .tp_call = (ternaryfunc)waiter_call,
};

/* Job.layer_waiter(stream, layers, timeout, timer, check, fail) -> Waiter (layers -1: unchecked;
 * timer None or a Timer of the job's core; check(layer, layers) and fail() raise). */
PyObject *kvo_make_waiter(JobObject *job, PyObject *args) {
    unsigned long long stream;
    long long layers;
    double timeout;
    PyObject *timer, *check, *fail;
    if (!PyArg_ParseTuple(args, "KLdOOO", &stream, &layers, &timeout, &timer, &check, &fail))
        return NULL;
    kvo_timer *timed;
    if (kvo_job_timer(job, timer, "layer_waiter", &timed) < 0) return NULL;
    if (!PyCallable_Check(check) || !PyCallable_Check(fail)) {
        PyErr_Format(PyExc_ValueError, "layer_waiter: expected callables check and fail, got %R, %R",
                     check, fail);
        return NULL;
    }
    int64_t n;
    int64_t *owner = kvo_job_slices(job, &n);
    if (owner == NULL) return NULL;
    WaiterObject *w = PyObject_New(WaiterObject, &WaiterType);
    if (w == NULL) {
        free(owner);
        return NULL;
    }
    Py_INCREF(job);
    w->job = job;
    w->timer = timer == Py_None ? NULL : (Py_INCREF(timer), timer);
    w->timed = timed;
    Py_INCREF(check);
    w->check = check;
    Py_INCREF(fail);
    w->fail = fail;
    w->stream = stream;
    w->timeout = timeout;
    w->layers = layers < 0 ? -1 : layers;
    w->n_owner = n;
    w->owner = owner;
    w->waited = -1;
    return (PyObject *)w;
}
