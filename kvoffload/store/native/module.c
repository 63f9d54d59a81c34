/* kvoffload.store._index: the Python face of the native block index (kvoffload/store/index.py
 * wraps it; that file has the contract).
 *
 * Index(num_slots, policy) holds the per-block bookkeeping in C: no Python object per block, so
 * nothing for the garbage collector to walk. Keys come as a list or tuple of bytes (any other
 * iterable is made a list first; an item that is not non-empty bytes is a key never found), or as
 * a C-contiguous uint8 buffer of shape (n, 16) or (16 * n,): one 16-byte key per row. Id arrays go
 * out as int64 in bytes (numpy.frombuffer reads them read-only, without a copy). A refusal raises
 * Refused(status, count, first) before anything changed; the wrapper words the message. The GIL
 * is the lock: no entry point releases it.
 */
#include <string.h>

#include "binding.h"

#define ABI 1

static PyObject *Refused;

/* The keys of one call, parsed; ``seq`` keeps the objects alive while ``keys`` point into them. */
typedef struct {
    ix_key *keys;
    Py_ssize_t n;
    PyObject *seq;     /* a list or tuple, or NULL for a buffer */
    Py_buffer view;
    int has_view;
} call_keys;

static void keys_done(call_keys *c) {
    PyMem_Free(c->keys);
    Py_XDECREF(c->seq);
    if (c->has_view) PyBuffer_Release(&c->view);
}

static int keys_from_buffer(PyObject *obj, call_keys *c) {
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    c->has_view = 1;
    const char *fmt = c->view.format ? c->view.format : "B";
    int rows = c->view.ndim == 2 && c->view.shape[1] == IX_KEY_BYTES;
    int flat = c->view.ndim == 1 && c->view.len % IX_KEY_BYTES == 0;
    if (c->view.itemsize != 1 || strchr("Bbc", fmt[0]) == NULL || !(rows || flat)) {
        PyErr_Format(PyExc_ValueError,
                     "expected keys as a uint8 array of shape (n, %d) or (%d * n,), got a "
                     "buffer of format %s, %d dimension(s) and %zd bytes",
                     IX_KEY_BYTES, IX_KEY_BYTES, fmt, c->view.ndim, c->view.len);
        return -1;
    }
    c->n = c->view.len / IX_KEY_BYTES;
    if (c->n > (Py_ssize_t)IX_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "expected fewer than 2**31 keys in one call, got %zd",
                     c->n);
        return -1;
    }
    c->keys = PyMem_Malloc((size_t)(c->n ? c->n : 1) * sizeof *c->keys);
    if (c->keys == NULL) return PyErr_NoMemory(), -1;
    const uint8_t *p = c->view.buf;
    for (Py_ssize_t i = 0; i < c->n; i++) ix_key_set(&c->keys[i], p + i * IX_KEY_BYTES, IX_KEY_BYTES);
    return 0;
}

static int keys_parse(PyObject *obj, call_keys *c) {
    memset(c, 0, sizeof *c);
    if (!PyList_Check(obj) && !PyTuple_Check(obj) && PyObject_CheckBuffer(obj) &&
        !PyBytes_Check(obj) && !PyByteArray_Check(obj))
        return keys_from_buffer(obj, c);
    if (PyBytes_Check(obj) || PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_ValueError, "expected a sequence of keys, got one %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    c->seq = PySequence_Fast(obj, "expected a sequence of keys");
    if (c->seq == NULL) return -1;
    c->n = PySequence_Fast_GET_SIZE(c->seq);
    if (c->n > (Py_ssize_t)IX_MAX_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "expected fewer than 2**31 keys in one call");
        return -1;
    }
    c->keys = PyMem_Malloc((size_t)(c->n ? c->n : 1) * sizeof *c->keys);
    if (c->keys == NULL) return PyErr_NoMemory(), -1;
    PyObject **items = PySequence_Fast_ITEMS(c->seq);
    for (Py_ssize_t i = 0; i < c->n; i++) {
        if (PyBytes_CheckExact(items[i]))
            ix_key_set(&c->keys[i], (const uint8_t *)PyBytes_AS_STRING(items[i]),
                       (size_t)PyBytes_GET_SIZE(items[i]));
        else
            ix_key_none(&c->keys[i]);
    }
    return 0;
}

/* The key object at position i of the call: the caller's own object, or bytes of a row. */
static PyObject *key_at(const call_keys *c, Py_ssize_t i) {
    if (c->seq != NULL) {
        PyObject *k = PySequence_Fast_GET_ITEM(c->seq, i);
        Py_INCREF(k);
        return k;
    }
    return PyBytes_FromStringAndSize((const char *)c->view.buf + i * IX_KEY_BYTES, IX_KEY_BYTES);
}

static PyObject *stored_key(const uint8_t b[IX_KEY_BYTES], uint8_t tag, const uint8_t *full) {
    if (tag == IX_TAG_LONG) {
        uint64_t len;
        memcpy(&len, full, 8);
        return PyBytes_FromStringAndSize((const char *)full + 8, (Py_ssize_t)len);
    }
    uint8_t out[IX_KEY_BYTES + 1];
    size_t n = ix_key_bytes(b, tag, out);
    return PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)n);
}

PyObject *ix_bind_fail(ix_status st, const ix_refusal *why) {
    if (st == IX_NOMEM) return PyErr_NoMemory();
    PyObject *args = Py_BuildValue("(iLL)", (int)st, (long long)why->count, (long long)why->first);
    if (args != NULL) PyErr_SetObject(Refused, args);
    Py_XDECREF(args);
    return NULL;
}

PyObject *ix_bind_int64s(const int64_t *v, int64_t n) { /* bytes: numpy reads them read-only */
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (out != NULL && n) memcpy(PyBytes_AS_STRING(out), v, (size_t)n * 8);
    return out;
}

static PyObject *dropped_keys(const ix_plan *plan) {
    PyObject *out = PyList_New(plan->n_evicted);
    for (int64_t i = 0; out != NULL && i < plan->n_evicted; i++) {
        PyObject *k = stored_key(plan->ev_keys[i].b, plan->ev_keys[i].tag, plan->ev_full[i]);
        if (k == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, k);
    }
    return out;
}

/* -- Index ------------------------------------------------------------------------------------- */

static int index_init(IndexObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"num_slots", "policy", "window", NULL};
    long long num_slots, window = 1;
    const char *policy;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Ls|L", names, &num_slots, &policy, &window))
        return -1;
    int kind = strcmp(policy, "lru") == 0 ? IX_LRU : strcmp(policy, "arc") == 0 ? IX_ARC : -1;
    if (kind < 0 || num_slots <= 0 || num_slots > (long long)IX_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "expected 0 < num_slots <= %u and a policy 'lru' or "
                     "'arc', got %lld and %s", IX_MAX_SLOTS, num_slots, policy);
        return -1;
    }
    if (window < 1 || window > (long long)IX_MAX_WINDOW) {
        PyErr_Format(PyExc_ValueError, "expected an eviction window of 1 to %u, got %lld",
                     IX_MAX_WINDOW, window);
        return -1;
    }
    if (self->ready) ix_free(&self->ix);
    self->ready = 0;
    if (ix_init(&self->ix, (uint32_t)num_slots, kind) != IX_OK) {
        ix_free(&self->ix);
        PyErr_NoMemory();
        return -1;
    }
    self->ix.window = (uint32_t)window;
    self->ready = 1;
    return 0;
}

static void index_dealloc(IndexObject *self) {
    if (self->ready) ix_free(&self->ix);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define KEYS_OR_NULL(obj, c) \
    if (keys_parse((obj), (c)) < 0) { keys_done(c); return NULL; }

static PyObject *index_lookup(IndexObject *self, PyObject *obj) {
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    int64_t n = ix_lookup(&self->ix, c.keys, c.n);
    keys_done(&c);
    return Py_BuildValue("(Ln)", (long long)n, c.n);
}

static PyObject *index_find(IndexObject *self, PyObject *key) {
    ix_key k;
    if (PyBytes_CheckExact(key))
        ix_key_set(&k, (const uint8_t *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
    else
        ix_key_none(&k);
    ix_status_of st = ix_state_of(&self->ix, &k);
    return Py_BuildValue("(iLI)", st.state, (long long)st.slot, (unsigned)st.readers);
}

static PyObject *index_counts(IndexObject *self, PyObject *noargs) {
    uint32_t c[4];
    ix_counts(&self->ix, c);
    return Py_BuildValue("(IIII)", c[0], c[1], c[2], c[3]);
}

/* prepare_store(keys, evicted_keys=True): evicted_keys False gives the count of the keys
 * evicted, not the keys (no bytes object made per evicted key, where no lower tier wants them). */
static PyObject *index_prepare_store(IndexObject *self, PyObject *args) {
    PyObject *obj;
    int want = 1;
    if (!PyArg_ParseTuple(args, "O|p", &obj, &want)) return NULL;
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    ix_plan plan;
    ix_refusal why = {0, -1};
    ix_status st = ix_prepare_store(&self->ix, c.keys, c.n, &plan, &why);
    PyObject *out = NULL;
    if (st != IX_OK) {
        ix_bind_fail(st, &why);
    } else {
        /* a list of the caller's own key objects; None for a buffer (its rows at ``positions``
         * are the keys: no bytes object is made per key) */
        PyObject *keys = c.seq != NULL ? PyList_New(plan.n) : Py_NewRef(Py_None);
        for (int64_t j = 0; c.seq != NULL && keys != NULL && j < plan.n; j++) {
            PyObject *k = key_at(&c, plan.pos[j]);
            if (k == NULL) Py_CLEAR(keys);
            else PyList_SET_ITEM(keys, j, k);
        }
        if (keys != NULL)
            out = Py_BuildValue("(NNNNLL)", keys, ix_bind_int64s(plan.pos, plan.n), ix_bind_int64s(plan.slots, plan.n),
                                want ? dropped_keys(&plan) : PyLong_FromLongLong(plan.n_evicted),
                                (long long)plan.skipped_present,
                                (long long)plan.skipped_full);
        /* out of memory for the result: the reserved slots go back to free (one key per call,
         * so the rollback allocates nothing); the blocks evicted for them stay evicted */
        for (int64_t j = 0; out == NULL && j < plan.n; j++)
            ix_complete_store(&self->ix, &c.keys[plan.pos[j]], 1, 0, &why);
    }
    ix_plan_free(&plan);
    keys_done(&c);
    return out;
}

static PyObject *index_complete_store(IndexObject *self, PyObject *args) {
    PyObject *obj;
    int success;
    if (!PyArg_ParseTuple(args, "Op", &obj, &success)) return NULL;
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    ix_refusal why = {0, -1};
    ix_status st = ix_complete_store(&self->ix, c.keys, c.n, success, &why);
    keys_done(&c);
    return st != IX_OK ? ix_bind_fail(st, &why) : PyLong_FromSsize_t(c.n);
}

static PyObject *acquire(IndexObject *self, PyObject *obj, int touch) {
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    int64_t *slots = PyMem_Malloc((size_t)(c.n ? c.n : 1) * sizeof *slots);
    PyObject *out = NULL;
    ix_refusal why = {0, -1};
    if (slots == NULL) {
        PyErr_NoMemory();
    } else {
        ix_status st = ix_acquire(&self->ix, c.keys, c.n, touch, slots, &why);
        out = st != IX_OK ? ix_bind_fail(st, &why) : ix_bind_int64s(slots, c.n);
    }
    PyMem_Free(slots);
    keys_done(&c);
    return out;
}

static PyObject *index_prepare_load(IndexObject *self, PyObject *obj) { return acquire(self, obj, 1); }

static PyObject *index_pin(IndexObject *self, PyObject *obj) { return acquire(self, obj, 0); }

static PyObject *index_release(IndexObject *self, PyObject *obj) {
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    ix_refusal why = {0, -1};
    ix_status st = ix_release(&self->ix, c.keys, c.n, &why);
    keys_done(&c);
    return st != IX_OK ? ix_bind_fail(st, &why) : PyLong_FromSsize_t(c.n);
}

static PyObject *index_touch(IndexObject *self, PyObject *obj) {
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    ix_touch(&self->ix, c.keys, c.n);
    keys_done(&c);
    return Py_NewRef(Py_None);
}

static PyObject *plan_keys(ix_status st, ix_plan *plan) {
    ix_refusal none = {0, -1};
    PyObject *out = st != IX_OK ? ix_bind_fail(st, &none) : dropped_keys(plan);
    ix_plan_free(plan);
    return out;
}

static PyObject *index_evict(IndexObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    ix_plan plan;
    return plan_keys(ix_evict(&self->ix, n < 0 ? 0 : n, &plan), &plan);
}

static PyObject *index_remove(IndexObject *self, PyObject *obj) {
    call_keys c;
    KEYS_OR_NULL(obj, &c);
    ix_plan plan;
    PyObject *out = plan_keys(ix_remove(&self->ix, c.keys, c.n, 0, &plan), &plan);
    keys_done(&c);
    return out;
}

static PyObject *index_reset(IndexObject *self, PyObject *noargs) {
    ix_plan plan;
    ix_status st = ix_remove(&self->ix, NULL, 0, 1, &plan);
    int64_t n = plan.n_evicted;
    ix_plan_free(&plan);
    return st != IX_OK ? PyErr_NoMemory() : PyLong_FromLongLong(n);
}

static PyObject *index_check(IndexObject *self, PyObject *noargs) {
    const char *bad = ix_check(&self->ix);
    return bad ? PyUnicode_FromString(bad) : Py_NewRef(Py_None);
}

static PyObject *index_nbytes(IndexObject *self, PyObject *noargs) {
    return PyLong_FromSize_t(ix_nbytes(&self->ix));
}

/* The keys as a list (a ghost's long key, of which only a digest is kept, as None); frees s. */
static PyObject *snap_list(ix_keylist *s) {
    PyObject *out = PyList_New(s->n);
    for (int64_t i = 0; out != NULL && i < s->n; i++) {
        const ix_key *k = &s->keys[i];
        PyObject *key = k->tag == IX_TAG_LONG && s->full[i] == NULL
                            ? Py_NewRef(Py_None)
                            : stored_key(k->b, k->tag, s->full[i]);
        if (key == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, key);
    }
    ix_keylist_free(s);
    return out;
}

/* The policy's whole state, for tests: (victim order, T1, T2, B1, B2, p); long ghosts as None. */
static PyObject *index_policy_state(IndexObject *self, PyObject *noargs) {
    ix_keylist s[IX_POLICY_LISTS];
    uint64_t p;
    if (ix_policy_lists(&self->ix, s, &p) != IX_OK) return PyErr_NoMemory();
    PyObject *got[IX_POLICY_LISTS];
    for (int i = 0; i < IX_POLICY_LISTS; i++) got[i] = snap_list(&s[i]);
    PyObject *order = got[0];
    if (order != NULL && got[1] != NULL) {
        Py_ssize_t n = PyList_GET_SIZE(order);
        if (PyList_SetSlice(order, n, n, got[1]) < 0) Py_CLEAR(order);
    }
    Py_XDECREF(got[1]);
    if (order == NULL) {
        for (int i = 2; i < IX_POLICY_LISTS; i++) Py_XDECREF(got[i]);
        return NULL;
    }
    return Py_BuildValue("(NNNNNK)", order, got[2], got[3], got[4], got[5],
                         (unsigned long long)p);
}

static PyMethodDef index_methods[] = {
    {"lookup", (PyCFunction)index_lookup, METH_O, "(leading READABLE keys, keys)"},
    {"find", (PyCFunction)index_find, METH_O, "(state, slot or -1, readers) of one key"},
    {"counts", (PyCFunction)index_counts, METH_NOARGS, "(free, writing, readable, pinned)"},
    {"prepare_store", (PyCFunction)index_prepare_store, METH_VARARGS,
     "(keys[, evicted_keys]) -> (keys or None for a buffer, positions, slots, evicted (keys, or "
     "their count), skipped_present, skipped_full)"},
    {"complete_store", (PyCFunction)index_complete_store, METH_VARARGS, "(keys, success): keys"},
    {"complete_store_slots", (PyCFunction)ix_bind_complete_slots, METH_VARARGS,
     "(slots, success): complete_store by the slots prepare_store gave"},
    {"release_slots", (PyCFunction)ix_bind_release_slots, METH_O,
     "release by the slots prepare_load or pin gave"},
    {"prepare_load", (PyCFunction)index_prepare_load, METH_O, "add a reader, touch; slots"},
    {"pin", (PyCFunction)index_pin, METH_O, "add a reader; slots"},
    {"release", (PyCFunction)index_release, METH_O, "drop a reader of each key; keys"},
    {"touch", (PyCFunction)index_touch, METH_O, "mark READABLE keys used"},
    {"evict", (PyCFunction)index_evict, METH_O, "evict up to n; their keys"},
    {"remove", (PyCFunction)index_remove, METH_O, "drop unpinned READABLE keys; those dropped"},
    {"reset", (PyCFunction)index_reset, METH_NOARGS, "drop every unpinned READABLE key"},
    {"check", (PyCFunction)index_check, METH_NOARGS, "None, or what contradicts itself"},
    {"nbytes", (PyCFunction)index_nbytes, METH_NOARGS, "bytes the index allocated"},
    {"policy_state", (PyCFunction)index_policy_state, METH_NOARGS, "for tests"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvoffload.store._index.Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)index_init,
    .tp_dealloc = (destructor)index_dealloc,
    .tp_methods = index_methods,
};

static PyMethodDef module_methods[] = {
    {"ids", ix_bind_ids, METH_VARARGS,
     "ids(obj, upper, distinct): engine block ids as int64 bytes, or None unless they fit"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_index", NULL, -1, module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__index(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Refused = PyErr_NewException("kvoffload.store._index.Refused", PyExc_ValueError, NULL);
    if (Refused == NULL || PyModule_AddObjectRef(m, "Refused", Refused) < 0 ||
        PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0 ||
        PyModule_AddIntConstant(m, "ABI", ABI) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", IX_MAX_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "REPEATS", IX_REPEATS) < 0 ||
        PyModule_AddIntConstant(m, "NOT_WRITING", IX_NOT_WRITING) < 0 ||
        PyModule_AddIntConstant(m, "NOT_READABLE", IX_NOT_READABLE) < 0 ||
        PyModule_AddIntConstant(m, "FEW_READERS", IX_FEW_READERS) < 0 ||
        PyModule_AddIntConstant(m, "BAD_KEY", IX_BAD_KEY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
