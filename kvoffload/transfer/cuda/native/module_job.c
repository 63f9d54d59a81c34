/* kvoffload.transfer.cuda._core.Job: one submitted transfer of one direction (binding.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "binding.h"

/* -- Job --------------------------------------------------------------------------------------- */

static void job_dealloc(JobObject *self) {
    if (self->job != NULL) {
        kvo_core *e = self->owner->e;
        kvo_job *job = self->job;
        Py_BEGIN_ALLOW_THREADS kvo_job_release(e, job);
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *job_done(JobObject *self, PyObject *noargs) {
    (void)noargs;
    int done = 0;
    kvo_job_done(self->owner->e, self->job, &done); /* an atomic read: never blocks */
    return PyBool_FromLong(done);
}

static PyObject *job_wait(JobObject *self, PyObject *args) {
    PyObject *t = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &t)) return NULL;
    double timeout = t == Py_None ? -1.0 : PyFloat_AsDouble(t);
    if (PyErr_Occurred()) return NULL;
    if (timeout < 0 && t != Py_None) timeout = 0;
    int finished = 0;
    kvo_core *e = self->owner->e;
    kvo_job *job = self->job;
    Py_BEGIN_ALLOW_THREADS kvo_job_wait(e, job, timeout, &finished);
    Py_END_ALLOW_THREADS return PyBool_FromLong(finished);
}

/* With the GIL held: the core's lock guards short sections that never take the GIL, so waiting
 * for it cannot deadlock, while releasing the GIL here would hand it to any other Python thread
 * that wants it and make the engine's thread wait to get it back (docs/api.md, "The GIL"). */
static int describe(JobObject *self, kvo_job_info *info) {
    kvo_job_describe(self->owner->e, self->job, info);
    return 0;
}

static PyObject *job_error(JobObject *self, PyObject *noargs) {
    (void)noargs;
    kvo_job_info i;
    describe(self, &i);
    if (i.settled && i.failed)
        return Py_BuildValue("(iiLLsi)", i.code, i.step, (long long)i.chunk, (long long)i.desc,
                             i.message, i.cancelled);
    Py_RETURN_NONE;
}

static PyObject *job_cancel(JobObject *self, PyObject *noargs) {
    (void)noargs;
    int cancelled = 0;
    kvo_core *e = self->owner->e;
    kvo_job *job = self->job;
    Py_BEGIN_ALLOW_THREADS kvo_job_cancel(e, job, &cancelled);
    Py_END_ALLOW_THREADS return PyBool_FromLong(cancelled);
}

int kvo_job_timer(JobObject *job, PyObject *obj, const char *where, kvo_timer **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (!PyObject_TypeCheck(obj, &TimerType) || ((TimerObject *)obj)->owner != job->owner) {
        PyErr_Format(PyExc_ValueError, "%s: expected a Timer of this job's core or None, got %R",
                     where, obj);
        return -1;
    }
    *out = ((TimerObject *)obj)->timer;
    return 0;
}

int64_t *kvo_job_slices(JobObject *job, int64_t *n) {
    kvo_job_info i;
    describe(job, &i);
    int64_t *v = malloc((size_t)(i.layers + 1) * sizeof *v);
    *n = 0;
    if (v == NULL) return (int64_t *)PyErr_NoMemory();
    kvo_job_layer_slices(job->owner->e, job->job, v, i.layers, n);
    return v;
}

int kvo_job_enqueue_wait(JobObject *job, unsigned long long stream, long long layer,
                         double timeout, kvo_timer *timer, int *ok) {
    kvo_core *e = job->owner->e;
    kvo_job *j = job->job;
    *ok = 1;
    if (kvo_job_landed(e, j, (int64_t)layer, ok)) return 0; /* GIL kept */
    char msg[KVO_MSG] = "";
    kvo_status rc;
    Py_BEGIN_ALLOW_THREADS rc = kvo_job_wait_on(e, j, (kvo_stream)(uintptr_t)stream,
                                                (int64_t)layer, timeout, timer, ok, msg);
    Py_END_ALLOW_THREADS if (rc == KVO_OK) return 0;
    raise_status(rc, msg);
    return -1;
}

/* wait_on(stream, layer=-1, timeout=30, timer=None): make `stream` wait on the GPU for the job
 * (or for `layer` of a load); returns at once. False when the job failed or never ran (the
 * stream does not wait for it); TimeoutError when a job queued behind another was not enqueued
 * in time. A Timer of the same core times the layer's wait, where one is enqueued. */
static PyObject *job_wait_on(JobObject *self, PyObject *args) {
    unsigned long long stream;
    long long layer = -1;
    double timeout = 30.0;
    PyObject *timer_obj = Py_None;
    if (!PyArg_ParseTuple(args, "K|LdO", &stream, &layer, &timeout, &timer_obj)) return NULL;
    kvo_timer *timer;
    int ok;
    if (kvo_job_timer(self, timer_obj, "wait_on", &timer) < 0 ||
        kvo_job_enqueue_wait(self, stream, layer, timeout, timer, &ok) < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

static PyObject *job_layer_waiter(JobObject *self, PyObject *args) {
    return kvo_make_waiter(self, args);
}

static PyObject *job_times(JobObject *self, PyObject *noargs) {
    (void)noargs;
    kvo_job_info i;
    describe(self, &i);
    return Py_BuildValue("(dddd)", i.t_submit, i.t_start, i.t_enqueued, i.t_done);
}

static PyObject *job_get_id(JobObject *self, void *c) {
    (void)c;
    kvo_job_info i;
    describe(self, &i);
    return PyLong_FromLongLong(i.id);
}

static PyObject *job_get_direction(JobObject *self, void *c) {
    (void)c;
    kvo_job_info i;
    describe(self, &i);
    return PyUnicode_FromString(i.dir == KVO_STORE ? "store" : "load");
}

static PyObject *job_get_slices(JobObject *self, void *c) {
    (void)c;
    kvo_job_info i;
    describe(self, &i);
    return PyLong_FromLongLong(i.slices);
}

static PyObject *job_get_layer_slice(JobObject *self, void *c) {
    (void)c;
    int64_t n;
    int64_t *v = kvo_job_slices(self, &n);
    if (v == NULL) return NULL;
    PyObject *out = kvo_int_list(v, n);
    free(v);
    return out;
}

static PyMethodDef job_methods[] = {
    {"done", (PyCFunction)job_done, METH_NOARGS, "True once finished (never blocks)"},
    {"wait", (PyCFunction)job_wait, METH_VARARGS, "wait(timeout=None) -> finished"},
    {"error", (PyCFunction)job_error, METH_NOARGS,
     "None, or (code, step, chunk, descriptor, message, cancelled) of a failed job"},
    {"cancel", (PyCFunction)job_cancel, METH_NOARGS, "True if the job will never run"},
    {"wait_on", (PyCFunction)job_wait_on, METH_VARARGS,
     "wait_on(stream, layer=-1, timeout=30, timer=None)"},
    {"layer_waiter", (PyCFunction)job_layer_waiter, METH_VARARGS,
     "layer_waiter(stream, layers, timeout, timer, check, fail) -> waiter(layer)"},
    {"times", (PyCFunction)job_times, METH_NOARGS,
     "(submitted, started, enqueued, done): monotonic seconds"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"id", (getter)job_get_id, NULL, "job id", NULL},
    {"direction", (getter)job_get_direction, NULL, "'store' or 'load'", NULL},
    {"slices", (getter)job_get_slices, NULL, "layer slices of a load (0 for a store)", NULL},
    {"layer_slice", (getter)job_get_layer_slice, NULL, "per layer, its slice (loads)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._core.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one submitted transfer of one direction",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

