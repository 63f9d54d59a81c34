/* The Python binding's shared declarations (module.c: the module and Engine; module_job.c: Job).
 * Bindings only: they call engine.h's functions and never the engine's lock or fields. */
#ifndef KVO_BINDING_H
#define KVO_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "engine.h"

typedef struct {
    PyObject_HEAD
    kvo_engine *e;
} EngineObject;

typedef struct {
    PyObject_HEAD
    EngineObject *owner;
    kvo_job *job;
} JobObject;

extern PyTypeObject EngineType, JobType;

/* Set the exception of a status (KVO_REFUSED: ValueError, KVO_TIMEOUT: TimeoutError, else
 * RuntimeError) with msg; returns NULL. */
PyObject *raise_status(kvo_status rc, const char *msg);
/* A Job object holding the caller's reference to job (released on failure). */
PyObject *new_job(EngineObject *owner, kvo_job *job);

#endif
