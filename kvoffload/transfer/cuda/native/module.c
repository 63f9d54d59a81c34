/* kvoffload.transfer.cuda._core: the Python face of the native transfer core (core.h).
 *
 * Core(driver, spec): driver is the address of a kvo_driver table (0: resolve libcuda.so.1's
 * entry points here), spec an int64 array (CoreSpec.pack()). Core.submit(specs, order) reads
 * each TransferSpec's direction, group and id arrays (by pointer) and hands them to the core
 * without the GIL: it returns one Job per direction. Jobs answer done(), wait(timeout), error(),
 * cancel(), wait_on(stream, layer, timeout) and times(); Core.finished() drains the ids of jobs
 * finished since the last call; Core.gate / gate_wait / gate_open are the layer gates.
 *
 * module.c binds the module and Core, module_job.c the Job type (binding.h). They only bind: it calls core.h's functions, never the core's lock or fields, and
 * releases the GIL around every call that can block (the core's threads may call driver entry
 * points that need the GIL: the CPU tests' fakes are Python callbacks). Status codes map to
 * exceptions in one place (raise_status).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "binding.h"
#include "drvtime.h"

static kvo_driver cuda_table;
static int cuda_resolved;

PyObject *kvo_int_list(const int64_t *v, int64_t n) {
    PyObject *out = PyList_New(n);
    for (int64_t i = 0; out != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) Py_CLEAR(out); /* never a list with NULL items */
        else PyList_SET_ITEM(out, i, x);
    }
    return out;
}

PyObject *raise_status(kvo_status rc, const char *msg) {
    PyObject *type = rc == KVO_REFUSED ? PyExc_ValueError
                     : rc == KVO_TIMEOUT ? PyExc_TimeoutError
                                         : PyExc_RuntimeError;
    PyErr_SetString(type, msg);
    return NULL;
}

static PyObject *resolve_cuda(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (!cuda_resolved) {
        char msg[KVO_MSG] = "";
        kvo_status rc;
        Py_BEGIN_ALLOW_THREADS rc = kvo_resolve(&cuda_table, msg);
        Py_END_ALLOW_THREADS if (rc != KVO_OK) {
            memset(&cuda_table, 0, sizeof cuda_table);
            return raise_status(KVO_FAILED, msg);
        }
        cuda_resolved = 1;
    }
    return PyLong_FromVoidPtr(&cuda_table);
}

static int check_open(CoreObject *self) {
    if (self->e != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "expected an initialized native core");
    return -1;
}

/* -- Core -------------------------------------------------------------------------------------- */

static int core_init(CoreObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"driver", "spec", NULL};
    unsigned long long driver;
    Py_buffer spec;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ky*", names, &driver, &spec)) return -1;
    if (self->e != NULL || spec.itemsize != 8 || spec.len % 8 != 0 ||
        !PyBuffer_IsContiguous(&spec, 'C')) {
        PyBuffer_Release(&spec);
        PyErr_SetString(PyExc_ValueError, self->e != NULL
                                              ? "Core.__init__: expected a new core"
                                              : "expected the core spec as a contiguous int64 array");
        return -1;
    }
    if (driver == 0) {
        PyObject *addr = resolve_cuda(NULL, NULL);
        if (addr == NULL) {
            PyBuffer_Release(&spec);
            return -1;
        }
        Py_DECREF(addr);
    }
    const kvo_driver *table = driver ? (const kvo_driver *)(uintptr_t)driver : &cuda_table;
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = NULL;
    Py_BEGIN_ALLOW_THREADS rc = kvo_core_open(table, spec.buf, spec.len / 8, &e, msg);
    Py_END_ALLOW_THREADS PyBuffer_Release(&spec);
    if (rc != KVO_OK) {
        raise_status(rc, msg);
        return -1;
    }
    self->e = e;
    self->table = table;
    kvo_timed_use(table, 1);
    return 0;
}

static void core_dealloc(CoreObject *self) {
    if (self->e != NULL) {
        kvo_core *e = self->e;
        Py_BEGIN_ALLOW_THREADS kvo_core_free(e);
        Py_END_ALLOW_THREADS self->e = NULL;
        kvo_timed_use(self->table, -1);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ids_of(PyObject *spec, const char *name, Py_buffer *view) {
    PyObject *arr = PyObject_GetAttrString(spec, name);
    if (arr == NULL) return -1;
    int rc = PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(arr);
    if (rc != 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) return -1; /* not the caller's input */
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

static PyObject *core_submit(CoreObject *self, PyObject *args) {
    PyObject *specs, *order_obj = Py_None;
    int background = 0;
    if (check_open(self) < 0) return NULL;
    if (!PyArg_ParseTuple(args, "O|Op", &specs, &order_obj, &background)) return NULL;
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
        /* The Python objects first, so that no job reaches the core without its Job: a job
         * running while its caller saw MemoryError could be submitted again, or its memory
         * reused, under it. One job per direction the specs name. */
        int want = 0;
        for (int d = 0; d < 2; d++)
            for (Py_ssize_t i = 0; i < n; i++)
                if (in[i].dir == d) {
                    want++;
                    break;
                }
        result = PyTuple_New(want);
        for (int k = 0; result != NULL && k < want; k++) {
            JobObject *j = PyObject_New(JobObject, &JobType);
            if (j == NULL) {
                Py_CLEAR(result);
                break;
            }
            j->owner = (CoreObject *)Py_NewRef(self);
            j->job = NULL; /* set below; a Job without one is released as nothing */
            PyTuple_SET_ITEM(result, k, (PyObject *)j);
        }
        if (result == NULL) goto out;
        kvo_job *jobs[2];
        int n_out = 0;
        char msg[KVO_MSG] = "";
        kvo_status rc;
        kvo_core *e = self->e;
        Py_BEGIN_ALLOW_THREADS rc = kvo_core_submit(e, in, n, (kvo_stream)(uintptr_t)order,
                                                      has_order, background, jobs, &n_out, msg);
        Py_END_ALLOW_THREADS if (rc != KVO_OK) {
            raise_status(rc, msg);
            Py_CLEAR(result);
            goto out;
        }
        for (int k = 0; k < n_out && k < want; k++)
            ((JobObject *)PyTuple_GET_ITEM(result, k))->job = jobs[k];
        for (int k = want; k < n_out; k++) { /* cannot happen: one job per direction named */
            kvo_job *extra = jobs[k];
            Py_BEGIN_ALLOW_THREADS kvo_job_release(e, extra);
            Py_END_ALLOW_THREADS
        }
        if (n_out != want) { /* cannot happen either; never hand out a Job without its job */
            Py_CLEAR(result);
            PyErr_Format(PyExc_RuntimeError, "submit: expected %d jobs from the core, got %d",
                         want, n_out);
        }
    }
out:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    free(views);
    free(in);
    Py_DECREF(seq);
    return result;
}

static PyObject *core_finished(CoreObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_open(self) < 0) return NULL;
    kvo_core *e = self->e;
    int64_t n = 0, *ids = NULL;
    kvo_status rc;
    Py_BEGIN_ALLOW_THREADS rc = kvo_core_finished(e, &ids, &n);
    Py_END_ALLOW_THREADS if (rc != KVO_OK) return PyErr_NoMemory();
    PyObject *out = kvo_int_list(ids, n);
    free(ids);
    return out;
}

static PyObject *core_close(CoreObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->e != NULL) {
        kvo_core *e = self->e;
        Py_BEGIN_ALLOW_THREADS kvo_core_close(e);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *core_stats(CoreObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_open(self) < 0) return NULL;
    kvo_stats s;
    kvo_core *e = self->e;
    Py_BEGIN_ALLOW_THREADS kvo_core_stats(e, &s);
    Py_END_ALLOW_THREADS return Py_BuildValue(
        "{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:i,s:i}", "submitted", (long long)s.submitted, "completed",
        (long long)s.completed, "reaped", (long long)s.reaped, "failed", (long long)s.failed, "parts", (long long)s.parts,
        "queued", (long long)s.queued, "in_flight", (long long)s.in_flight, "closed", s.closed,
        "batch_copies", s.batch_copies);
}

static PyObject *core_gate(CoreObject *self, PyObject *args) {
    long long layers;
    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "L", &layers)) return NULL;
    int64_t gate = -1;
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = self->e;
    Py_BEGIN_ALLOW_THREADS rc = kvo_gate_create(e, layers, &gate, msg);
    Py_END_ALLOW_THREADS if (rc != KVO_OK) return raise_status(rc, msg);
    return PyLong_FromLongLong(gate);
}

static PyObject *core_stall_timer(CoreObject *self, PyObject *args) {
    long long layers;
    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "L", &layers)) return NULL;
    kvo_timer *t = NULL;
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = self->e;
    Py_BEGIN_ALLOW_THREADS rc = kvo_timer_create(e, layers, &t, msg);
    Py_END_ALLOW_THREADS if (rc != KVO_OK) return raise_status(rc, msg);
    TimerObject *o = PyObject_New(TimerObject, &TimerType);
    if (o == NULL) {
        kvo_timer_free(e, t);
        return NULL;
    }
    Py_INCREF(self);
    o->owner = self;
    o->timer = t;
    return (PyObject *)o;
}

static PyObject *core_gate_wait(CoreObject *self, PyObject *args) {
    long long gate, layer;
    unsigned long long stream;
    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "LKL", &gate, &stream, &layer)) return NULL;
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = self->e;
    Py_BEGIN_ALLOW_THREADS rc = kvo_gate_wait(e, gate, (kvo_stream)(uintptr_t)stream, layer, msg);
    Py_END_ALLOW_THREADS if (rc != KVO_OK) return raise_status(rc, msg);
    Py_RETURN_NONE;
}

static PyObject *core_gate_open(CoreObject *self, PyObject *args) {
    long long gate;
    unsigned long long stream;
    PyObject *jobs_obj;
    double timeout = 30.0;
    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "LKO|d", &gate, &stream, &jobs_obj, &timeout))
        return NULL;
    PyObject *seq = PySequence_Fast(jobs_obj, "expected a sequence of Job");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    kvo_job **jobs = calloc((size_t)(n > 0 ? n : 1), sizeof *jobs);
    if (jobs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyObject_TypeCheck(item, &JobType) || ((JobObject *)item)->owner != self) {
            free(jobs);
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "expected jobs of this core, got %R", item);
            return NULL;
        }
        jobs[i] = ((JobObject *)item)->job;
    }
    char msg[KVO_MSG] = "";
    kvo_status rc;
    kvo_core *e = self->e;
    Py_BEGIN_ALLOW_THREADS rc = kvo_gate_open(e, gate, (kvo_stream)(uintptr_t)stream, jobs, n,
                                              timeout, msg);
    Py_END_ALLOW_THREADS free(jobs);
    Py_DECREF(seq); /* the jobs stay alive while seq holds them */
    if (rc != KVO_OK) return raise_status(rc, msg);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"submit", (PyCFunction)core_submit, METH_VARARGS,
     "submit(specs, order_stream=None, background=False) -> tuple of Job (one per direction); "
     "background: the core's worker threads enqueue the copies, never this thread"},
    {"finished", (PyCFunction)core_finished, METH_NOARGS,
     "ids of the jobs finished since the last call (tracking starts at the first call)"},
    {"close", (PyCFunction)core_close, METH_NOARGS,
     "cancel queued jobs, wait for those in flight, stop the threads"},
    {"stats", (PyCFunction)core_stats, METH_NOARGS, "counters"},
    {"gate", (PyCFunction)core_gate, METH_VARARGS, "gate(layers) -> a new layer gate's index"},
    {"stall_timer", (PyCFunction)core_stall_timer, METH_VARARGS,
     "stall_timer(layers) -> a Timer for Job.wait_on"},
    {"gate_wait", (PyCFunction)core_gate_wait, METH_VARARGS,
     "gate_wait(gate, stream, layer): enqueue 'wait until open' (capturable)"},
    {"gate_open", (PyCFunction)core_gate_open, METH_VARARGS,
     "gate_open(gate, stream, jobs, timeout=30): close every layer on stream, then open each "
     "once the jobs landed it"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.transfer.cuda._core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(driver, spec): the native transfer core",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
};

/* timed_driver(address): a timed table over the driver table at address (drvtime.h). */
static PyObject *timed_driver(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    const kvo_driver *t = addr ? kvo_timed_driver((const kvo_driver *)(uintptr_t)addr) : NULL;
    if (t == NULL) {
        PyErr_SetString(PyExc_ValueError, "timed_driver: expected the address of the driver table "
                                          "already timed or none in use, got another");
        return NULL;
    }
    return PyLong_FromVoidPtr((void *)t);
}

/* driver_times(reset): [(calls, ns)] per driver entry point, this thread, through a timed table. */
static PyObject *driver_times(PyObject *self, PyObject *arg) {
    (void)self;
    int reset = PyObject_IsTrue(arg);
    if (reset < 0) return NULL;
    int64_t calls[KVO_DRIVER_FIELDS], ns[KVO_DRIVER_FIELDS];
    kvo_driver_times(calls, ns, reset);
    PyObject *out = PyList_New(KVO_DRIVER_FIELDS);
    for (int i = 0; out != NULL && i < KVO_DRIVER_FIELDS; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)calls[i], (long long)ns[i]);
        if (pair == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, pair);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"cuda_driver", resolve_cuda, METH_NOARGS,
     "address of the driver table resolved from libcuda.so.1 (RuntimeError saying why not)"},
    {"timed_driver", timed_driver, METH_O, "timed_driver(address) -> a timed table's address"},
    {"driver_times", driver_times, METH_O,
     "driver_times(reset) -> [(calls, ns)] per driver entry point in this thread"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_core", "The native transfer core (kvoffload/transfer/cuda/native/).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&JobType) < 0 ||
        PyType_Ready(&TimerType) < 0 || PyType_Ready(&WaiterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CoreType);
    Py_INCREF(&JobType);
    PyModule_AddObject(m, "Core", (PyObject *)&CoreType);
    PyModule_AddObject(m, "Job", (PyObject *)&JobType);
    Py_INCREF(&TimerType);
    PyModule_AddObject(m, "Timer", (PyObject *)&TimerType);
    PyModule_AddIntConstant(m, "ABI", KVO_ABI);
    PyModule_AddIntConstant(m, "DRIVER_FIELDS", KVO_DRIVER_FIELDS);
    return m;
}
