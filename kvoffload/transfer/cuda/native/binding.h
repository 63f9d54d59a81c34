/* The Python binding's shared declarations (module.c: the module and Core; module_job.c: Job;
 * module_timer.c: Timer; module_waiter.c: Waiter).
 * Bindings only: they call core.h's functions and never the core's lock or fields. */
#ifndef KVO_BINDING_H
#define KVO_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"

typedef struct {
    PyObject_HEAD
    kvo_core *e;
    const kvo_driver *table; /* the driver table it was opened on */
} CoreObject;

typedef struct {
    PyObject_HEAD
    CoreObject *owner;
    kvo_job *job;
} JobObject;

typedef struct {
    PyObject_HEAD
    CoreObject *owner;
    kvo_timer *timer;
} TimerObject;

extern PyTypeObject CoreType, JobType, TimerType, WaiterType;

/* Job.layer_waiter(stream, layers, timeout, timer, check, fail) -> Waiter (module_waiter.c). */
PyObject *kvo_make_waiter(JobObject *job, PyObject *args);

/* module_job.c, shared with the waiter: */
/* obj None (*out NULL) or a Timer of the job's core (*out its timer); else -1, ValueError set
 * ("<where>: expected a Timer of this job's core or None, got ..."). */
int kvo_job_timer(JobObject *job, PyObject *obj, const char *where, kvo_timer **out);
/* Per layer of the job, its slice (*n of them), malloc'd; NULL with MemoryError set. */
int64_t *kvo_job_slices(JobObject *job, int64_t *n);
/* Job.wait_on's work: `stream` waits for `layer` (-1: the whole job); 0 (*ok: the job did not
 * fail) or -1 with the exception set. A landed layer returns with the GIL held. */
int kvo_job_enqueue_wait(JobObject *job, unsigned long long stream, long long layer,
                         double timeout, kvo_timer *timer, int *ok);

/* Set the exception of a status (KVO_REFUSED: ValueError, KVO_TIMEOUT: TimeoutError, else
 * RuntimeError) with msg; returns NULL. */
PyObject *raise_status(kvo_status rc, const char *msg);
PyObject *kvo_int_list(const int64_t *v, int64_t n); /* a list of ints; NULL (set) on no memory */

#endif
