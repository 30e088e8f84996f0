/* gzip inflation by a thread that never takes the GIL (the Kineto parser's reader).
 *
 * The Kineto parser scans a gzipped trace's text while a second thread inflates the next chunks.
 * With zlib.decompressobj() that thread takes the GIL back for every block added to its output and
 * at every return, each time waiting for the scanning thread to let go of it: inflation ran at half
 * speed and the threads mostly took turns. Reader.run() reads and inflates the whole file with the
 * GIL released throughout, into a ring of preallocated bytes objects that next() hands out in order
 * (no copy). Failures are reported as kineto._gunzip words them: see outcome().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

/* ------------------------------------------------------------------------------------------ */
/* Reader: a whole gzip file inflated by a thread that never takes the GIL */

#define READ_BYTES 65536  /* compressed bytes read at a time (as kineto._RAW_READ_BYTES) */

typedef struct {
    PyObject_HEAD
    int fd;
    Py_ssize_t chunk;
    int nslots;
    PyObject **slots;        /* bytes objects of `chunk` bytes, owned; filled by the producer */
    Py_ssize_t *fill;
    int *full;
    int head, tail;          /* next slot for next() / for the producer */
    int done, stop, started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int status;              /* 0 clean end, 1 stream ends early, 2 corrupt data, 3 read error */
    int zerr;
    char zmsg[200];
    long long fed;           /* compressed bytes read before the failing read (or in all) */
    int err_no;
} Reader;

static void reader_dealloc(Reader *self) {
    if (self->slots) {
        for (int k = 0; k < self->nslots; k++) Py_XDECREF(self->slots[k]);
        PyMem_Free(self->slots);
    }
    PyMem_Free(self->fill);
    PyMem_Free(self->full);
    pthread_mutex_destroy(&self->mu);
    pthread_cond_destroy(&self->cv);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int fd, nslots = 4;
    Py_ssize_t chunk = 1 << 20;
    static char *kwlist[] = {"fd", "chunk", "ahead", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|ni", kwlist, &fd, &chunk, &nslots)) return NULL;
    if (chunk < 1024 || chunk > (1 << 30) || nslots < 1 || nslots > 64) {
        PyErr_SetString(PyExc_ValueError, "chunk must be within 1 KiB..1 GiB and ahead within 1..64");
        return NULL;
    }
    Reader *self = (Reader *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->fd = fd;
    self->chunk = chunk;
    self->nslots = nslots;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    self->slots = PyMem_Calloc(nslots, sizeof(PyObject *));
    self->fill = PyMem_Calloc(nslots, sizeof(Py_ssize_t));
    self->full = PyMem_Calloc(nslots, sizeof(int));
    if (!self->slots || !self->fill || !self->full) { Py_DECREF(self); return PyErr_NoMemory(); }
    for (int k = 0; k < nslots; k++) {
        self->slots[k] = PyBytes_FromStringAndSize(NULL, chunk);
        if (!self->slots[k]) { Py_DECREF(self); return NULL; }
    }
    return (PyObject *)self;
}

/* Producer: hand over slot `tail` holding n bytes, then wait until the next slot is free.
 * Returns a pointer to the next slot's memory, or NULL when asked to stop. Called without the GIL. */
static char *publish(Reader *self, Py_ssize_t n) {
    pthread_mutex_lock(&self->mu);
    self->fill[self->tail] = n;
    self->full[self->tail] = 1;
    self->tail = (self->tail + 1) % self->nslots;
    pthread_cond_broadcast(&self->cv);
    while (self->full[self->tail] && !self->stop) pthread_cond_wait(&self->cv, &self->mu);
    char *out = self->stop ? NULL : PyBytes_AS_STRING(self->slots[self->tail]);
    pthread_mutex_unlock(&self->mu);
    return out;
}

static int all_zero(const unsigned char *p, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) if (p[k]) return 0;
    return 1;
}

static PyObject *reader_run(Reader *self, PyObject *unused) {
    pthread_mutex_lock(&self->mu);
    int again = self->started;
    self->started = 1;
    pthread_mutex_unlock(&self->mu);
    if (again) { PyErr_SetString(PyExc_RuntimeError, "run() was already called"); return NULL; }
    unsigned char *in = PyMem_RawMalloc(READ_BYTES);  /* not on this thread's stack, whatever its size */
    if (!in) return PyErr_NoMemory();
    int init = Z_OK;
    Py_BEGIN_ALLOW_THREADS
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    init = inflateInit2(&zs, 31);
    long long fed = 0;
    int eof = 0, status = 0;
    Py_ssize_t filled = 0, chunk = self->chunk;
    pthread_mutex_lock(&self->mu);
    char *out = self->stop ? NULL : PyBytes_AS_STRING(self->slots[self->tail]);
    pthread_mutex_unlock(&self->mu);
    while (init == Z_OK && out) {
        pthread_mutex_lock(&self->mu);
        int stop = self->stop;
        pthread_mutex_unlock(&self->mu);
        if (stop) break;
        ssize_t r;
        /* pread from our own offset: the caller's buffered file object may have read ahead */
        do { r = pread(self->fd, in, READ_BYTES, (off_t)fed); } while (r < 0 && errno == EINTR);
        if (r < 0) { status = 3; self->err_no = errno; break; }
        if (r == 0) break;
        const unsigned char *data = in;
        Py_ssize_t left = r;
        while (left > 0 && out) {
            if (eof) {
                if (all_zero(data, left)) break;  /* zero padding after the last member */
                inflateReset(&zs);                /* concatenated gzip members */
                eof = 0;
            }
            zs.next_in = (Bytef *)data;
            zs.avail_in = (uInt)left;
            zs.next_out = (Bytef *)(out + filled);
            zs.avail_out = (uInt)(chunk - filled);
            int e = inflate(&zs, Z_SYNC_FLUSH);
            Py_ssize_t used = left - zs.avail_in, produced = (chunk - filled) - zs.avail_out;
            data += used;
            left -= used;
            filled += produced;
            if (e == Z_STREAM_END) eof = 1;
            else if (e != Z_OK && e != Z_BUF_ERROR) {
                status = 2;
                self->zerr = e;
                snprintf(self->zmsg, sizeof(self->zmsg), "%s", zs.msg ? zs.msg : "unknown error");
                break;
            }
            if (filled == chunk) {
                out = publish(self, filled);
                filled = 0;
            } else if (used == 0 && produced == 0) {
                break;  /* needs more input */
            }
        }
        if (status) break;
        fed += r;
    }
    if (out && filled > 0) publish(self, filled);
    pthread_mutex_lock(&self->mu);
    int stopped = self->stop;
    pthread_mutex_unlock(&self->mu);
    if (init == Z_OK && status == 0 && !eof && !stopped) status = 1;
    inflateEnd(&zs);
    pthread_mutex_lock(&self->mu);
    self->status = init == Z_OK ? status : 2;
    if (init != Z_OK) { self->zerr = init; snprintf(self->zmsg, sizeof(self->zmsg), "inflateInit2 failed"); }
    self->fed = fed;
    self->done = 1;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(in);
    Py_RETURN_NONE;
}

/* The next decompressed chunk (bytes), or None after the last one. */
static PyObject *reader_next(Reader *self, PyObject *unused) {
    int ready = 0;
    Py_ssize_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    /* (closed before run() started: nothing will come) */
    while (!self->full[self->head] && !self->done && !(self->stop && !self->started))
        pthread_cond_wait(&self->cv, &self->mu);
    ready = self->full[self->head];
    n = self->fill[self->head];
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (!ready) Py_RETURN_NONE;
    /* the producer does not touch a full slot: take its bytes object and put a fresh one there */
    PyObject *fresh = PyBytes_FromStringAndSize(NULL, self->chunk);
    if (!fresh) return NULL;
    PyObject *got = self->slots[self->head];
    if (n != self->chunk && _PyBytes_Resize(&got, n) < 0) {
        self->slots[self->head] = fresh;  /* got was freed by the failed resize */
        goto release;
    }
    self->slots[self->head] = fresh;
release:
    pthread_mutex_lock(&self->mu);
    self->full[self->head] = 0;
    self->head = (self->head + 1) % self->nslots;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    return got;  /* NULL with the error set when the resize failed */
}

static PyObject *reader_close(Reader *self, PyObject *unused) {
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

/* (status, zlib error code, zlib message, compressed bytes read before the failure, errno) */
static PyObject *reader_outcome(Reader *self, PyObject *unused) {
    return Py_BuildValue("(iisLi)", self->status, self->zerr, self->zmsg, self->fed, self->err_no);
}

static PyMethodDef reader_methods[] = {
    {"run", (PyCFunction)reader_run, METH_NOARGS, "inflate the whole file (call from a second thread)"},
    {"next", (PyCFunction)reader_next, METH_NOARGS, "the next decompressed chunk, None after the last"},
    {"close", (PyCFunction)reader_close, METH_NOARGS, "ask run() to stop early"},
    {"outcome", (PyCFunction)reader_outcome, METH_NOARGS,
     "(status 0 clean / 1 ends early / 2 corrupt / 3 read error, zlib code, zlib message, compressed bytes "
     "read before the failing read, errno), valid once next() returned None"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "analysis.parsers._kinflate.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(fd, chunk=1 MiB, ahead=4): gzip file (read from its start) -> decompressed chunks.\n"
              "One thread calls run(), which reads and inflates everything without the GIL; another calls\n"
              "next() until it returns None, then outcome(). At most `ahead` chunks wait. close() before\n"
              "dropping a reader whose run() may still be going, then join that thread.",
    .tp_methods = reader_methods,
    .tp_new = reader_new,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kinflate", "gzip inflation without the GIL.", -1, NULL,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kinflate(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
