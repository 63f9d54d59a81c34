/* kvoffload.transfer.cuda._engine: the Python face of the native transfer engine.
 *
 * Engine(driver, spec): driver is the address of a kvo_driver table (0: resolve libcuda.so.1's
 * entry points here), spec an int64 array (EngineSpec.pack()). Engine.submit(specs, order) reads
 * each TransferSpec's direction, group and id arrays (by pointer), then, without the GIL,
 * validates, copies the ids, records the order event on the caller's stream and queues the job:
 * it returns one Job per direction. Jobs answer done(), wait(timeout), error(), cancel(),
 * wait_on(stream, layer) and times(); Engine.finished() drains the ids of jobs finished since the
 * last call. Every wait runs with the GIL released.
 *
 * LOCKING: a thread holding the GIL never waits for the engine's mutex. The engine's threads call
 * driver entry points while holding it, and entry points may need the GIL (the CPU tests' fakes
 * are Python callbacks), so every call here that takes the mutex releases the GIL first, and
 * Python objects are built only after the mutex is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "kvo.h"

#define ABI 1

typedef struct {
    PyObject_HEAD
    kvo_engine *e;
    int started;
} EngineObject;

typedef struct {
    PyObject_HEAD
    EngineObject *owner;
    kvo_job *job;
} JobObject;

static PyTypeObject EngineType, JobType;
static kvo_driver cuda_table;
static int cuda_resolved;

static PyObject *resolve_cuda(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (!cuda_resolved) {
        const char *why;
        Py_BEGIN_ALLOW_THREADS why = kvo_resolve(&cuda_table);
        Py_END_ALLOW_THREADS if (why != NULL) {
            memset(&cuda_table, 0, sizeof cuda_table);
            PyErr_SetString(PyExc_RuntimeError, why);
            return NULL;
        }
        cuda_resolved = 1;
    }
    return PyLong_FromVoidPtr(&cuda_table);
}

/* -- Engine ------------------------------------------------------------------------------------ */

static int engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"driver", "spec", NULL};
    unsigned long long driver;
    Py_buffer spec;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ky*", names, &driver, &spec)) return -1;
    if (self->e != NULL) {
        PyBuffer_Release(&spec);
        PyErr_SetString(PyExc_RuntimeError, "Engine.__init__: expected a new engine");
        return -1;
    }
    if (spec.itemsize != 8 || spec.len % 8 != 0 || !PyBuffer_IsContiguous(&spec, 'C')) {
        PyBuffer_Release(&spec);
        PyErr_SetString(PyExc_ValueError, "expected the engine spec as a contiguous int64 array");
        return -1;
    }
    kvo_engine *e = calloc(1, sizeof *e);
    if (e == NULL) {
        PyBuffer_Release(&spec);
        PyErr_NoMemory();
        return -1;
    }
    if (driver == 0) {
        PyObject *addr = resolve_cuda(NULL, NULL);
        if (addr == NULL) {
            free(e);
            PyBuffer_Release(&spec);
            return -1;
        }
        Py_DECREF(addr);
        e->d = cuda_table;
    } else {
        memcpy(&e->d, (void *)(uintptr_t)driver, sizeof e->d);
    }
    const char *why = kvo_spec_parse(&e->spec, spec.buf, spec.len / 8);
    PyBuffer_Release(&spec);
    if (why != NULL) {
        kvo_spec_free(&e->spec);
        free(e);
        PyErr_SetString(PyExc_ValueError, why);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS why = kvo_engine_start(e);
    Py_END_ALLOW_THREADS self->e = e;
    self->started = 1;
    if (why != NULL) {
        PyErr_SetString(PyExc_RuntimeError, why);
        return -1;
    }
    return 0;
}

static void engine_close_now(EngineObject *self) {
    if (self->e == NULL || !self->started) return;
    Py_BEGIN_ALLOW_THREADS kvo_engine_close(self->e);
    Py_END_ALLOW_THREADS
}

static void engine_dealloc(EngineObject *self) {
    if (self->e != NULL) {
        engine_close_now(self);
        kvo_spec_free(&self->e->spec);
        free(self->e->seen_slots);
        free(self->e->seen_blocks);
        free(self->e->finished);
        free(self->e->pool);
        free(self->e);
        self->e = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(EngineObject *self) {
    if (self->e == NULL) {
        PyErr_SetString(PyExc_ValueError, "expected an initialized native engine");
        return -1;
    }
    return 0;
}

static int ids_of(PyObject *spec, const char *name, Py_buffer *view) {
    PyObject *arr = PyObject_GetAttrString(spec, name);
    if (arr == NULL) return -1;
    int rc = PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(arr);
    if (rc != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "expected %s as a contiguous int64 array", name);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (view->itemsize != 8 || view->ndim != 1 || (strcmp(f, "l") && strcmp(f, "q") && strcmp(f, "<q") && strcmp(f, "<l") && strcmp(f, "=q") && strcmp(f, "=l"))) {
        PyErr_Format(PyExc_ValueError, "expected %s as a 1-D int64 array, got format %s ndim %d",
                     name, f, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *new_job(EngineObject *owner, kvo_job *job) {
    JobObject *j = PyObject_New(JobObject, &JobType);
    if (j == NULL) {
        kvo_job_release(owner->e, job);
        return NULL;
    }
    Py_INCREF(owner);
    j->owner = owner;
    j->job = job;
    return (PyObject *)j;
}

static PyObject *engine_submit(EngineObject *self, PyObject *args) {
    PyObject *specs, *order_obj = Py_None;
    if (check_open(self) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "O|O", &specs, &order_obj)) return NULL;
    PyObject *seq = PySequence_Fast(specs, "expected a sequence of TransferSpec");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    unsigned long long order = 0;
    int has_order = order_obj != Py_None;
    if (has_order) {
        order = PyLong_AsUnsignedLongLong(order_obj);
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    kvo_input *in = calloc((size_t)(n > 0 ? n : 1), sizeof *in);
    Py_buffer *views = calloc((size_t)(2 * n + 1), sizeof *views);
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (in == NULL || views == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *spec = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *dir = PyObject_GetAttrString(spec, "direction");
        if (dir == NULL) goto out;
        int store = PyUnicode_Check(dir) && PyUnicode_CompareWithASCIIString(dir, "store") == 0;
        int load = PyUnicode_Check(dir) && PyUnicode_CompareWithASCIIString(dir, "load") == 0;
        if (!store && !load) {
            PyErr_Format(PyExc_ValueError, "expected direction 'store' or 'load', got %R", dir);
            Py_DECREF(dir);
            goto out;
        }
        Py_DECREF(dir);
        PyObject *group = PyObject_GetAttrString(spec, "group");
        if (group == NULL) goto out;
        long long g = PyLong_Check(group) && !PyBool_Check(group) ? PyLong_AsLongLong(group) : -1;
        if (g == -1 && (!PyLong_Check(group) || PyBool_Check(group) || PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "expected an int layer group, got %R", group);
            Py_DECREF(group);
            goto out;
        }
        Py_DECREF(group);
        if (ids_of(spec, "blocks", &views[held]) < 0) goto out;
        held++;
        if (ids_of(spec, "slots", &views[held]) < 0) goto out;
        held++;
        Py_ssize_t nb = views[held - 2].len / 8, ns = views[held - 1].len / 8;
        if (nb != ns) {
            PyErr_Format(PyExc_ValueError,
                         "expected as many host slots as engine blocks, got %zd slots for %zd "
                         "blocks", ns, nb);
            goto out;
        }
        in[i].dir = store ? KVO_STORE : KVO_LOAD;
        in[i].group = g;
        in[i].n = nb;
        in[i].blocks = views[held - 2].buf;
        in[i].slots = views[held - 1].buf;
    }
    {
        kvo_job *jobs[2];
        int n_out = 0, rc;
        char err[300] = "";
        Py_BEGIN_ALLOW_THREADS rc = kvo_engine_submit(self->e, in, n, (kvo_stream)(uintptr_t)order,
                                                      has_order, jobs, &n_out, err, sizeof err);
        Py_END_ALLOW_THREADS if (rc != 0) {
            PyErr_SetString(rc > 0 ? PyExc_ValueError : PyExc_RuntimeError, err);
            goto out;
        }
        result = PyTuple_New(n_out);
        for (int k = 0; k < n_out; k++) {
            PyObject *job = result ? new_job(self, jobs[k]) : NULL;
            if (job == NULL) {
                for (int m = k + (result ? 1 : 0); m < n_out; m++) kvo_job_release(self->e, jobs[m]);
                Py_CLEAR(result);
                break;
            }
            PyTuple_SET_ITEM(result, k, job);
        }
    }
out:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    free(views);
    free(in);
    Py_DECREF(seq);
    return result;
}

static PyObject *engine_finished(EngineObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_open(self) < 0) return NULL;
    kvo_engine *e = self->e;
    int64_t n, *ids;
    Py_BEGIN_ALLOW_THREADS /* see LOCKING */
    pthread_mutex_lock(&e->mu);
    e->track_finished = 1;
    n = e->finished_n;
    ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    if (ids != NULL) {
        memcpy(ids, e->finished, (size_t)n * sizeof *ids);
        e->finished_n = 0;
    }
    pthread_mutex_unlock(&e->mu);
    Py_END_ALLOW_THREADS
    if (ids == NULL) return PyErr_NoMemory();
    PyObject *out = PyList_New(n);
    for (int64_t i = 0; out && i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLongLong(ids[i]));
    free(ids);
    return out;
}

static PyObject *engine_close(EngineObject *self, PyObject *noargs) {
    (void)noargs;
    engine_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *engine_stats(EngineObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_open(self) < 0) return NULL;
    kvo_engine *e = self->e;
    long long queued = 0, inflight = 0, submitted, completed, failures, parts;
    int closing;
    Py_BEGIN_ALLOW_THREADS /* copied under the lock, built after it: see LOCKING */
    pthread_mutex_lock(&e->mu);
    for (int d = 0; d < 2; d++)
        for (kvo_job *j = e->queue_head[d]; j; j = j->next) queued++;
    for (kvo_job *j = e->inflight; j; j = j->next) inflight++;
    submitted = e->submitted;
    completed = e->completed;
    failures = e->failures;
    parts = e->native_parts;
    closing = e->closing;
    pthread_mutex_unlock(&e->mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:i,s:i}", "submitted", submitted,
                         "completed", completed, "failed", failures, "parts", parts, "queued",
                         queued, "in_flight", inflight, "closed", closing, "batch_copies",
                         e->d.batch != NULL);
}

static PyMethodDef engine_methods[] = {
    {"submit", (PyCFunction)engine_submit, METH_VARARGS,
     "submit(specs, order_stream=None) -> tuple of Job (one per direction)"},
    {"finished", (PyCFunction)engine_finished, METH_NOARGS,
     "ids of the jobs finished since the last call (tracking starts at the first call)"},
    {"close", (PyCFunction)engine_close, METH_NOARGS,
     "cancel queued jobs, wait for those in flight, stop the threads"},
    {"stats", (PyCFunction)engine_stats, METH_NOARGS, "counters"},
    {NULL, NULL, 0, NULL},
};

/* -- Job --------------------------------------------------------------------------------------- */

static void job_dealloc(JobObject *self) {
    if (self->job != NULL) {
        kvo_engine *e = self->owner->e;
        kvo_job *job = self->job;
        Py_BEGIN_ALLOW_THREADS kvo_job_release(e, job); /* see LOCKING */
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static PyObject *job_done(JobObject *self, PyObject *noargs) {
    (void)noargs;
    return PyBool_FromLong(__atomic_load_n(&self->job->state, __ATOMIC_ACQUIRE) == KVO_DONE);
}

static PyObject *job_wait(JobObject *self, PyObject *args) {
    PyObject *t = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &t)) return NULL;
    double timeout = t == Py_None ? -1.0 : PyFloat_AsDouble(t);
    if (PyErr_Occurred()) return NULL;
    if (timeout < 0 && t != Py_None) timeout = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS ok = kvo_job_wait(self->owner->e, self->job, timeout);
    Py_END_ALLOW_THREADS return PyBool_FromLong(ok);
}

static PyObject *job_error(JobObject *self, PyObject *noargs) {
    (void)noargs;
    kvo_job *j = self->job;
    kvo_engine *e = self->owner->e;
    /* copied under the lock, built after it: building objects may run the garbage collector,
     * whose Job deallocations take the same lock */
    char message[sizeof j->message];
    int done, failed, code, step, cancelled;
    long long chunk, desc;
    Py_BEGIN_ALLOW_THREADS /* never wait for the lock holding the GIL: see LOCKING */
    pthread_mutex_lock(&e->mu);
    done = j->state >= KVO_INFLIGHT; /* the message is final */
    failed = j->failed;
    code = j->code;
    step = j->step;
    cancelled = j->cancelled;
    chunk = j->chunk;
    desc = j->desc;
    memcpy(message, j->message, sizeof message);
    pthread_mutex_unlock(&e->mu);
    Py_END_ALLOW_THREADS
    if (done && failed)
        return Py_BuildValue("(iiLLsi)", code, step, chunk, desc, message, cancelled);
    Py_RETURN_NONE;
}

static PyObject *job_cancel(JobObject *self, PyObject *noargs) {
    (void)noargs;
    int ok;
    Py_BEGIN_ALLOW_THREADS ok = kvo_job_cancel(self->owner->e, self->job); /* see LOCKING */
    Py_END_ALLOW_THREADS return PyBool_FromLong(ok);
}

/* wait_on(stream, layer=-1, timeout): make `stream` wait on the GPU for the job (or for the
 * slice of a load holding `layer`); on the host only until that event is recorded. Returns
 * False when the job failed before it (the stream still waits for the job's end), True else;
 * raises TimeoutError after `timeout` s of waiting for the enqueue. */
static PyObject *job_wait_on(JobObject *self, PyObject *args) {
    unsigned long long stream;
    long long layer = -1;
    double timeout = 30.0;
    if (!PyArg_ParseTuple(args, "K|Ld", &stream, &layer, &timeout)) return NULL;
    kvo_engine *e = self->owner->e;
    kvo_job *j = self->job;
    int rc = 0, ok = 1;
    Py_BEGIN_ALLOW_THREADS
    void *prev = kvo_ctx_enter(e);
    int64_t k = -1;
    if (layer >= 0 && layer < j->n_layers && j->layer_slice && j->n_slices > 0)
        k = j->layer_slice[layer];
    int have = k >= 0 ? kvo_job_wait_slice(e, j, k, timeout) : 0;
    if (have < 0) {
        rc = -1;
    } else {
        pthread_mutex_lock(&e->mu);
        int state = j->state, failed = j->failed, closed = e->closing;
        pthread_mutex_unlock(&e->mu);
        if (have == 1 && !(failed && (int64_t)j->recorded <= k)) {
            rc = closed && state == KVO_DONE ? 0 : e->d.wait((kvo_stream)(uintptr_t)stream, j->slices[k], 0);
        } else {
            /* the whole job: wait for its enqueue, then for its done event */
            double deadline = kvo_now() + timeout;
            pthread_mutex_lock(&e->mu);
            while (j->state < KVO_INFLIGHT && kvo_now() < deadline) {
                struct timespec ts;
                ts.tv_sec = (time_t)deadline;
                ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
                pthread_cond_timedwait(&e->changed, &e->mu, &ts);
            }
            state = j->state;
            failed = j->failed;
            int recorded = j->done_recorded;
            closed = e->closing;
            pthread_mutex_unlock(&e->mu);
            if (state < KVO_INFLIGHT) rc = -1;
            else {
                if (recorded && !(closed && state == KVO_DONE))
                    rc = e->d.wait((kvo_stream)(uintptr_t)stream, j->done_ev, 0);
                ok = !failed;
            }
        }
    }
    kvo_ctx_leave(e, prev);
    Py_END_ALLOW_THREADS
    if (rc == -1) {
        PyErr_Format(PyExc_TimeoutError, "the copy was not enqueued within %g s", timeout);
        return NULL;
    }
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "cuStreamWaitEvent failed: %s", kvo_error_name(&e->d, rc));
        return NULL;
    }
    return PyBool_FromLong(ok);
}

static PyObject *job_times(JobObject *self, PyObject *noargs) {
    (void)noargs;
    kvo_job *j = self->job;
    double t[5];
    Py_BEGIN_ALLOW_THREADS /* copied under the lock, built after it: see LOCKING */
    pthread_mutex_lock(&self->owner->e->mu);
    t[0] = j->t_submit;
    t[1] = j->t_start;
    t[2] = j->t_enqueued;
    t[3] = j->t_first_slice;
    t[4] = j->t_done;
    pthread_mutex_unlock(&self->owner->e->mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ddddd)", t[0], t[1], t[2], t[3], t[4]);
}

static PyObject *job_get_id(JobObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->job->id);
}
static PyObject *job_get_direction(JobObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(self->job->dir == KVO_STORE ? "store" : "load");
}
static PyObject *job_get_slices(JobObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(self->job->n_slices);
}
static PyObject *job_get_layer_slice(JobObject *self, void *c) {
    (void)c;
    kvo_job *j = self->job;
    PyObject *out = PyList_New(j->n_slices > 0 ? j->n_layers : 0);
    for (int64_t l = 0; out && j->n_slices > 0 && l < j->n_layers; l++)
        PyList_SET_ITEM(out, l, PyLong_FromLongLong(j->layer_slice[l]));
    return out;
}

static PyMethodDef job_methods[] = {
    {"done", (PyCFunction)job_done, METH_NOARGS, "True once finished (never blocks)"},
    {"wait", (PyCFunction)job_wait, METH_VARARGS, "wait(timeout=None) -> finished"},
    {"error", (PyCFunction)job_error, METH_NOARGS,
     "None, or (code, step, chunk, descriptor, message, cancelled) of a failed job"},
    {"cancel", (PyCFunction)job_cancel, METH_NOARGS, "True if the job will never run"},
    {"wait_on", (PyCFunction)job_wait_on, METH_VARARGS, "wait_on(stream, layer=-1, timeout=30)"},
    {"times", (PyCFunction)job_times, METH_NOARGS,
     "(submitted, started, enqueued, first slice recorded, done): monotonic seconds"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"id", (getter)job_get_id, NULL, "job id", NULL},
    {"direction", (getter)job_get_direction, NULL, "'store' or 'load'", NULL},
    {"slices", (getter)job_get_slices, NULL, "layer slices of a load (0 for a store)", NULL},
    {"layer_slice", (getter)job_get_layer_slice, NULL, "per layer, its slice (loads)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._engine.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(driver, spec): the native transfer engine",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._engine.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one submitted transfer of one direction",
    .tp_dealloc = (destructor)job_dealloc,
    .tp_methods = job_methods,
    .tp_getset = job_getset,
};

static PyMethodDef module_methods[] = {
    {"cuda_driver", resolve_cuda, METH_NOARGS,
     "address of the driver table resolved from libcuda.so.1 (RuntimeError saying why not)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_engine", "The native transfer engine (kvoffload/transfer/cuda/native/).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&JobType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&EngineType);
    Py_INCREF(&JobType);
    PyModule_AddObject(m, "Engine", (PyObject *)&EngineType);
    PyModule_AddObject(m, "Job", (PyObject *)&JobType);
    PyModule_AddIntConstant(m, "ABI", ABI);
    PyModule_AddIntConstant(m, "DRIVER_FIELDS", KVO_DRIVER_FIELDS);
    return m;
}
