/* The native index's binding (module.c binds the module and Index; bind_ids.c the calls on
 * int64 id arrays). The binding only calls ix.h's functions. */
#ifndef IX_BINDING_H
#define IX_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ix.h"

typedef struct {
    PyObject_HEAD
    ix_index ix;
    int ready;
} IndexObject;

PyObject *ix_bind_fail(ix_status st, const ix_refusal *why); /* Refused(status, count, first) */
PyObject *ix_bind_int64s(const int64_t *v, int64_t n);       /* bytes of n int64s */
PyObject *ix_bind_ids(PyObject *self, PyObject *args);
PyObject *ix_bind_complete_slots(IndexObject *self, PyObject *args);
PyObject *ix_bind_release_slots(IndexObject *self, PyObject *obj);

#endif
