/* kvoffload.transfer.cuda._core.Timer: a stall timer (core.h, stall.c) for Job.wait_on. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "binding.h"

static void timer_dealloc(TimerObject *self) {
    if (self->timer != NULL) {
        kvo_core *e = self->owner->e;
        kvo_timer *t = self->timer;
        Py_BEGIN_ALLOW_THREADS kvo_timer_free(e, t);
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *timer_reset(TimerObject *self, PyObject *noargs) {
    (void)noargs;
    kvo_timer_reset(self->timer);
    Py_RETURN_NONE;
}

/* read() -> per layer: seconds its stream stood at the timed wait (0.0 where none was timed),
 * None where the stream has not passed that wait yet. */
static PyObject *timer_read(TimerObject *self, PyObject *noargs) {
    (void)noargs;
    long long layers = (long long)kvo_timer_layers(self->timer);
    double *v = malloc((size_t)(layers > 0 ? layers : 1) * sizeof *v);
    if (v == NULL) return PyErr_NoMemory();
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = self->owner->e;
    kvo_timer *t = self->timer;
    Py_BEGIN_ALLOW_THREADS rc = kvo_timer_read(e, t, v, msg);
    Py_END_ALLOW_THREADS PyObject *out = NULL;
    if (rc != KVO_OK) {
        raise_status(rc, msg);
    } else if ((out = PyList_New((Py_ssize_t)layers)) != NULL) {
        for (long long i = 0; i < layers; i++) {
            PyObject *x = v[i] < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(v[i]);
            if (x == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, (Py_ssize_t)i, x);
        }
    }
    free(v);
    return out;
}

static PyObject *timer_own_seconds(TimerObject *self, PyObject *noargs) {
    (void)noargs;
    return PyFloat_FromDouble(kvo_timer_own_s(self->timer));
}

static PyMethodDef timer_methods[] = {
    {"reset", (PyCFunction)timer_reset, METH_NOARGS, "every layer untimed again"},
    {"own_seconds", (PyCFunction)timer_own_seconds, METH_NOARGS,
     "own_seconds() -> host seconds of the timer's own event records since the last reset"},
    {"read", (PyCFunction)timer_read, METH_NOARGS,
     "read() -> per layer the seconds its stream stood at its timed wait (0.0: none "
     "timed, None: not passed yet)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._core.Timer",
    .tp_basicsize = sizeof(TimerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a stall timer: per layer the time a stream stood at a load's wait",
    .tp_dealloc = (destructor)timer_dealloc,
    .tp_methods = timer_methods,
};
