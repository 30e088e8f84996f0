/* Fast path of the Kineto trace parser (analysis/parsers/kineto.py): scans complete traceEvents
 * array elements from a buffer and appends their rows to the collector's column lists.
 *
 * It handles only what it can handle exactly as the typed msgspec path (kineto's _Event / _Args)
 * would, and stops at the first event where it cannot say so: bytes that are not valid JSON, a
 * field of another type than Kineto writes (a string stream, a null name, a float pid), an integer
 * of more than 18 digits in a typed field, an escaped key, a repeated key, nesting deeper than 64.
 * It returns the offset where it stopped; the Python parser carries on from there with the decoders
 * that handle everything, so results never depend on whether this module is built (the tests
 * compare both). Collective rows get the args the collective columns need, metadata events what
 * the thread names need, so the common path never imports msgspec.
 *
 * scan(buf, pos, ctx) -> (end, why, events, specials, metadata, phases, no_cat_ts_dur, trace_span,
 *                          unwanted)
 *   buf: bytes; pos: offset of the first element (separators before it are skipped);
 *   ctx: tuple (cols, category, names, ids, durs, kinds, kernel_kind, cpu_coll, cpu_collective,
 *               decode_json, undecodable)
 *     cols: list of the 17 column lists in kineto.COLUMNS order (rank and the collective, step and
 *     launch columns are left for the caller to pad);
 *     category(cat) -> (canonical or None when not wanted, is a CPU collective category);
 *     names / ids / durs: dicts sharing repeated values; kinds: name -> kernel kind, filled through
 *     kernel_kind(name); cpu_coll: name -> collective or None, filled through cpu_collective(name);
 *     decode_json(bytes) -> the value, for strings with escapes and array / object args, or the
 *     `undecodable` marker where msgspec refuses it (the event is then left to the Python path).
 *   end: offset after the last event taken (and its separators); why: 0 the buffer ends inside the
 *   next element, 1 the next byte is not the start of an object (e.g. the closing ']'), 2 the next
 *   element is one this scanner leaves to the Python path;
 *   specials: [(row index, args)] rows that may be collectives, args in kineto._Args' field order
 *   (Input Dims and Input type as raw JSON bytes); metadata: [(name, pid, tid, args.name)] of the
 *   ph "M" events; phases: {ph: count} of the other phases.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64
#define NCOLS 18
enum { C_RANK, C_PID, C_TID, C_STREAM, C_CAT, C_NAME, C_TS, C_DUR, C_KIND, C_COLL, C_MSG, C_MSGFROM,
       C_GROUP, C_GSIZE, C_SEQ, C_STEP, C_CORR, C_LAUNCH };

/* results of the low-level scanners */
#define OK 0
#define INCOMPLETE 1   /* the buffer ends inside the value */
#define INVALID 2      /* not JSON, or not what the typed path accepts */
#define PYERR 3        /* a Python exception is set */

typedef struct {
    const unsigned char *p, *end;
} Cur;

/* one scanned field */
enum { T_ABSENT, T_NULL, T_STR, T_INT, T_FLOAT };
typedef struct {
    int type;
    const unsigned char *s;   /* string: bytes between the quotes; number: its text */
    Py_ssize_t n;
    int escaped;              /* string holds backslash escapes */
    long long i;
    double d;
} Field;

static inline void skip_ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t')) c->p++;
}

/* Validate UTF-8 of [s, e) (only called when a byte >= 0x80 occurs). */
static int valid_utf8(const unsigned char *s, const unsigned char *e) {
    while (s < e) {
        unsigned char b = *s;
        if (b < 0x80) { s++; continue; }
        int n; uint32_t cp;
        if (b >= 0xC2 && b <= 0xDF) { n = 1; cp = b & 0x1F; }
        else if (b >= 0xE0 && b <= 0xEF) { n = 2; cp = b & 0x0F; }
        else if (b >= 0xF0 && b <= 0xF4) { n = 3; cp = b & 0x07; }
        else return 0;
        if (e - s <= n) return 0;
        for (int k = 1; k <= n; k++) {
            if ((s[k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[k] & 0x3F);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
            return 0;
        s += n + 1;
    }
    return 1;
}

static inline int is_hex(unsigned char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

/* Bytes that end the plain run of a string: the quote, backslash, control characters, non-ASCII. */
static unsigned char string_stop[256];

static void init_tables(void) {
    for (int k = 0; k < 256; k++) string_stop[k] = (k == '"' || k == '\\' || k < 0x20 || k >= 0x80);
}

/* c->p at the opening quote. */
static int scan_string(Cur *c, Field *f) {
    const unsigned char *s = ++c->p;
    int escaped = 0, high = 0;
    for (;;) {
        const unsigned char *q = c->p, *e = c->end;
        /* eight bytes at a time while none of them can end the plain run */
        const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
        while (e - q >= 8) {
            uint64_t x, dq, db;
            memcpy(&x, q, 8);
            dq = x ^ (ones * '"');
            db = x ^ (ones * '\\');
            if ((((dq - ones) & ~dq) | ((db - ones) & ~db) | ((x - ones * 0x20) & ~x) | x) & highs) break;
            q += 8;
        }
        while (q < e && !string_stop[*q]) q++;
        c->p = q;
        if (q >= c->end) return INCOMPLETE;
        unsigned char ch = *q;
        if (ch == '"') break;
        if (ch < 0x20) return INVALID;
        if (ch >= 0x80) { high = 1; c->p++; continue; }
        /* backslash */
        escaped = 1;
        if (q + 1 >= c->end) return INCOMPLETE;
        unsigned char x = q[1];
        if (x == 'u') {
            if (q + 6 > c->end) return INCOMPLETE;
            for (int k = 2; k < 6; k++) if (!is_hex(q[k])) return INVALID;
            /* a surrogate (paired or not): msgspec and json differ on lone ones, leave it to them */
            if ((q[2] == 'd' || q[2] == 'D') && ((q[3] >= '8' && q[3] <= '9') || (q[3] >= 'a' && q[3] <= 'f')
                                                 || (q[3] >= 'A' && q[3] <= 'F')))
                return INVALID;
            c->p = q + 6;
        } else if (x == '"' || x == '\\' || x == '/' || x == 'b' || x == 'f' || x == 'n' || x == 'r' || x == 't') {
            c->p = q + 2;
        } else {
            return INVALID;
        }
    }
    if (high && !valid_utf8(s, c->p)) return INVALID;
    if (f) { f->type = T_STR; f->s = s; f->n = c->p - s; f->escaped = escaped; }
    c->p++;  /* closing quote */
    return OK;
}

/* c->p at '-' or a digit. */
static int scan_number(Cur *c, Field *f) {
    const unsigned char *s = c->p, *q = c->p, *e = c->end;
    int is_float = 0;
    if (q < e && *q == '-') q++;
    if (q >= e) return INCOMPLETE;
    if (*q == '0') q++;
    else if (*q >= '1' && *q <= '9') { while (q < e && *q >= '0' && *q <= '9') q++; }
    else return INVALID;
    if (q < e && *q == '.') {
        is_float = 1; q++;
        if (q >= e) return INCOMPLETE;
        if (!(*q >= '0' && *q <= '9')) return INVALID;
        while (q < e && *q >= '0' && *q <= '9') q++;
    }
    if (q < e && (*q == 'e' || *q == 'E')) {
        is_float = 1; q++;
        if (q < e && (*q == '+' || *q == '-')) q++;
        if (q >= e) return INCOMPLETE;
        if (!(*q >= '0' && *q <= '9')) return INVALID;
        while (q < e && *q >= '0' && *q <= '9') q++;
    }
    if (q >= e) return INCOMPLETE;  /* the number may go on in the next chunk */
    c->p = q;
    if (!f) return OK;
    f->s = s; f->n = q - s;
    if (!is_float) {
        const unsigned char *d = s;
        int neg = 0;
        if (*d == '-') { neg = 1; d++; }
        if (q - d > 18) return INVALID;  /* leave big integers to the Python path */
        long long v = 0;
        for (; d < q; d++) v = v * 10 + (*d - '0');
        f->type = T_INT; f->i = neg ? -v : v;
    } else {
        char tmp[64];
        if (f->n >= (Py_ssize_t)sizeof(tmp)) return INVALID;
        memcpy(tmp, s, f->n); tmp[f->n] = 0;
        char *endp = NULL;
        double v = PyOS_string_to_double(tmp, &endp, NULL);
        if (v == -1.0 && PyErr_Occurred()) { PyErr_Clear(); return INVALID; }
        if (!endp || *endp) return INVALID;
        if (!(v - v == 0.0)) return INVALID;  /* inf: msgspec rejects out-of-range numbers differently */
        f->type = T_FLOAT; f->d = v;
    }
    return OK;
}

static int scan_literal(Cur *c, const char *word, Py_ssize_t n) {
    if (c->end - c->p < n) {
        if (memcmp(c->p, word, c->end - c->p) == 0) return INCOMPLETE;
        return INVALID;
    }
    if (memcmp(c->p, word, n) != 0) return INVALID;
    c->p += n;
    if (c->p >= c->end) return INCOMPLETE;  /* keep the rule: a value never ends the buffer */
    return OK;
}

static int skip_value(Cur *c, int depth);

static int skip_container(Cur *c, int depth, unsigned char close) {
    if (depth > MAX_DEPTH) return INVALID;
    c->p++;
    skip_ws(c);
    if (c->p >= c->end) return INCOMPLETE;
    if (*c->p == close) { c->p++; return OK; }
    for (;;) {
        int r;
        if (close == '}') {
            if (*c->p != '"') return INVALID;
            if ((r = scan_string(c, NULL)) != OK) return r;
            skip_ws(c);
            if (c->p >= c->end) return INCOMPLETE;
            if (*c->p != ':') return INVALID;
            c->p++;
            skip_ws(c);
            if (c->p >= c->end) return INCOMPLETE;
        }
        if ((r = skip_value(c, depth + 1)) != OK) return r;
        skip_ws(c);
        if (c->p >= c->end) return INCOMPLETE;
        if (*c->p == ',') {
            c->p++;
            skip_ws(c);
            if (c->p >= c->end) return INCOMPLETE;
            continue;
        }
        if (*c->p == close) { c->p++; return OK; }
        return INVALID;
    }
}

/* c->p at the first byte of a value (not whitespace, not the end). */
static int skip_value(Cur *c, int depth) {
    switch (*c->p) {
    case '"': return scan_string(c, NULL);
    case '{': return skip_container(c, depth, '}');
    case '[': return skip_container(c, depth, ']');
    case 't': return scan_literal(c, "true", 4);
    case 'f': return scan_literal(c, "false", 5);
    case 'n': return scan_literal(c, "null", 4);
    default:
        if (*c->p == '-' || (*c->p >= '0' && *c->p <= '9')) return scan_number(c, NULL);
        return INVALID;
    }
}

/* A value into f when it is one of `allowed` (bit 1<<T_*); INVALID for another type. */
static int scan_field(Cur *c, Field *f, int allowed) {
    int r;
    unsigned char ch = *c->p;
    if (f->type != T_ABSENT) return INVALID;  /* repeated key */
    if (ch == '"') r = scan_string(c, f);
    else if (ch == 'n') { r = scan_literal(c, "null", 4); f->type = T_NULL; }
    else if (ch == '-' || (ch >= '0' && ch <= '9')) r = scan_number(c, f);
    else r = skip_value(c, 1) == INCOMPLETE ? INCOMPLETE : INVALID;  /* object, array, bool */
    if (r != OK) return r;
    if (!((1 << f->type) & allowed)) return INVALID;
    return OK;
}

#define KEYIS(k, n, lit) ((n) == (Py_ssize_t)sizeof(lit) - 1 && memcmp((k), (lit), sizeof(lit) - 1) == 0)

/* args read for the collective columns (kineto._Args, same order) and, last, args.name of metadata */
#define NARGS 13
static const char *const ARG_KEYS[NARGS] = {
    "Collective name", "In msg nelems", "Out msg nelems", "In msg size", "Out msg size", "dtype", "Group size",
    "Process Group Name", "Process Group Ranks", "Seq", "Input Dims", "Input type", "name"};
#define ARG_INPUT_DIMS 10  /* Input Dims and Input type stay raw JSON (bytes) */
#define ARG_NAME 12

typedef struct {
    const unsigned char *s, *e;  /* the value's bytes; s == NULL: absent */
} Span;

typedef struct {
    Field ph, cat, name, pid, tid, ts, dur, stream, corr;
    Span arg[NARGS];
    int nargs_seen;
    int args_seen;
    const unsigned char *start, *stop;
} Event;

/* An object member's key and the ':' after it; c->p then at the value. */
static inline int member_key(Cur *c, Field *key) {
    key->type = T_ABSENT;
    if (*c->p != '"') return INVALID;
    int r = scan_string(c, key);
    if (r != OK) return r;
    skip_ws(c);
    if (c->p >= c->end) return INCOMPLETE;
    if (*c->p != ':') return INVALID;
    c->p++;
    skip_ws(c);
    return c->p >= c->end ? INCOMPLETE : OK;
}

#define MORE 4  /* member_next: a ',' and the start of the next member */

/* After a member's value: MORE at a ',' (c->p then at the next key), OK at the closing '}' (taken). */
static inline int member_next(Cur *c) {
    skip_ws(c);
    if (c->p >= c->end) return INCOMPLETE;
    if (*c->p == ',') {
        c->p++;
        skip_ws(c);
        return c->p >= c->end ? INCOMPLETE : MORE;
    }
    if (*c->p == '}') { c->p++; return OK; }
    return INVALID;
}

/* An object's members: the ones of interest into fields, the rest skipped (validated). */
static int scan_args(Cur *c, Event *ev) {
    c->p++;  /* '{' */
    skip_ws(c);
    if (c->p >= c->end) return INCOMPLETE;
    if (*c->p == '}') { c->p++; return OK; }
    for (;;) {
        Field key;
        int r = member_key(c, &key);
        if (r != OK) return r;
        int which = -1;
        if (!key.escaped && KEYIS(key.s, key.n, "stream"))
            r = scan_field(c, &ev->stream, (1 << T_NULL) | (1 << T_INT));
        else if (!key.escaped && KEYIS(key.s, key.n, "correlation"))
            r = scan_field(c, &ev->corr, (1 << T_NULL) | (1 << T_INT));
        else if (key.escaped)
            r = INVALID;  /* an escaped key may spell a field name: leave it to msgspec */
        else {
            for (int k = 0; k < NARGS; k++)
                if ((size_t)key.n == strlen(ARG_KEYS[k]) && memcmp(key.s, ARG_KEYS[k], key.n) == 0) { which = k; break; }
            if (which >= 0 && ev->arg[which].s) return INVALID;  /* repeated: msgspec decides */
            const unsigned char *v = c->p;
            r = skip_value(c, 2);
            if (r == OK && which >= 0) { ev->arg[which].s = v; ev->arg[which].e = c->p; ev->nargs_seen = 1; }
        }
        if (r != OK) return r;
        if ((r = member_next(c)) != MORE) return r;
    }
}

static int scan_event(Cur *c, Event *ev) {
    /* only the types need resetting (a field's other members are set with its type); a memset of
     * the whole struct was a fifth of the scanning time */
    ev->ph.type = ev->cat.type = ev->name.type = ev->pid.type = ev->tid.type = T_ABSENT;
    ev->ts.type = ev->dur.type = ev->stream.type = ev->corr.type = T_ABSENT;
    ev->ph.escaped = ev->cat.escaped = ev->name.escaped = 0;
    if (ev->nargs_seen) {
        for (int k = 0; k < NARGS; k++) ev->arg[k].s = NULL;
        ev->nargs_seen = 0;
    }
    ev->args_seen = 0;
    ev->stop = NULL;
    ev->start = c->p;
    c->p++;  /* '{' */
    skip_ws(c);
    if (c->p >= c->end) return INCOMPLETE;
    if (*c->p == '}') { c->p++; ev->stop = c->p; return OK; }
    const int STRNULL = (1 << T_NULL) | (1 << T_STR);
    const int ID = (1 << T_NULL) | (1 << T_STR) | (1 << T_INT);
    const int NUM = (1 << T_NULL) | (1 << T_INT) | (1 << T_FLOAT);
    for (;;) {
        Field key;
        int r = member_key(c, &key);
        if (r != OK) return r;
        const unsigned char *k = key.s;
        Py_ssize_t n = key.n;
        if (key.escaped) r = INVALID;
        else if (KEYIS(k, n, "ph")) {
            r = scan_field(c, &ev->ph, STRNULL);
            if (r == OK && ev->ph.type == T_STR && ev->ph.escaped) r = INVALID;  /* an escaped ph may spell X or M */
        }
        else if (KEYIS(k, n, "cat")) r = scan_field(c, &ev->cat, STRNULL);
        else if (KEYIS(k, n, "name")) r = scan_field(c, &ev->name, 1 << T_STR);
        else if (KEYIS(k, n, "pid")) r = scan_field(c, &ev->pid, ID);
        else if (KEYIS(k, n, "tid")) r = scan_field(c, &ev->tid, ID);
        else if (KEYIS(k, n, "ts")) r = scan_field(c, &ev->ts, NUM);
        else if (KEYIS(k, n, "dur")) r = scan_field(c, &ev->dur, NUM);
        else if (KEYIS(k, n, "args")) {
            if (ev->args_seen) return INVALID;
            ev->args_seen = 1;
            if (*c->p != '{') r = skip_value(c, 1) == INCOMPLETE ? INCOMPLETE : INVALID;
            else r = scan_args(c, ev);
        } else r = skip_value(c, 1);
        if (r != OK) return r;
        if ((r = member_next(c)) != MORE) {
            if (r == OK) ev->stop = c->p;
            return r;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Python objects for fields */

static PyObject *str_of(Field *f, PyObject *decode_str) {
    if (f->type != T_STR) return PyUnicode_FromStringAndSize("", 0);
    if (!f->escaped) return PyUnicode_DecodeUTF8((const char *)f->s, f->n, NULL);
    PyObject *raw = PyBytes_FromStringAndSize((const char *)f->s - 1, f->n + 2);
    if (!raw) return NULL;
    PyObject *out = PyObject_CallOneArg(decode_str, raw);
    Py_DECREF(raw);
    return out;
}

/* New reference to a field's value (None when absent or null). */
static PyObject *value_of(Field *f, PyObject *decode_str) {
    switch (f->type) {
    case T_STR: return str_of(f, decode_str);
    case T_INT: return PyLong_FromLongLong(f->i);
    case T_FLOAT: return PyFloat_FromDouble(f->d);
    default: Py_RETURN_NONE;
    }
}

/* A value from decode_json, or NULL with *leave set when decode_json gave the `undecodable` marker
 * (msgspec refused it: the Python path is to take the event). NULL without *leave: an error. */
static PyObject *checked(PyObject *v, PyObject *undecodable, int *leave) {
    if (v && v == undecodable) {
        Py_DECREF(v);
        *leave = 1;
        return NULL;
    }
    return v;
}

/* the values of a kept row, in the order they are appended (R_ARGS: the args of a collective) */
enum { R_PID, R_TID, R_STREAM, R_CAT, R_NAME, R_TS, R_DUR, R_KIND, R_CORR, R_ARGS, NROW };

/* An args value as the typed msgspec path gives it (new reference): Input Dims / Input type as the
 * raw JSON bytes (b"" when absent), the others as Python values (None when absent); strings with
 * escapes, arrays and objects through decode_json (msgspec, imported when first needed). */
static PyObject *arg_value(const Span *a, int raw, PyObject *decode_json) {
    if (raw) {
        if (!a->s) return PyBytes_FromStringAndSize(NULL, 0);
        return PyBytes_FromStringAndSize((const char *)a->s, a->e - a->s);
    }
    if (!a->s) Py_RETURN_NONE;
    unsigned char ch = a->s[0];
    if (ch == 'n') Py_RETURN_NONE;
    if (ch == 't') Py_RETURN_TRUE;
    if (ch == 'f') Py_RETURN_FALSE;
    if (ch == '"' || ch == '-' || (ch >= '0' && ch <= '9')) {
        /* the value was validated by skip_value; rescan it into a Field (a sentinel-free copy of
         * the cursor: the value ends before a->e, which lies inside the buffer) */
        Field f;
        f.type = T_ABSENT;
        f.escaped = 0;
        Cur c = {a->s, a->e + 1};
        int r = ch == '"' ? scan_string(&c, &f) : scan_number(&c, &f);
        if (r == OK && !(f.type == T_STR && f.escaped)) return value_of(&f, NULL);
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)a->s, a->e - a->s);
    if (!bytes) return NULL;
    PyObject *out = PyObject_CallOneArg(decode_json, bytes);
    Py_DECREF(bytes);
    return out;
}

static PyObject *args_tuple(const Event *ev, PyObject *decode_json, PyObject *undecodable, int *leave) {
    PyObject *t = PyTuple_New(ARG_NAME);
    if (!t) return NULL;
    for (int k = 0; k < ARG_NAME; k++) {
        PyObject *v = checked(arg_value(&ev->arg[k], k >= ARG_INPUT_DIMS, decode_json), undecodable, leave);
        if (!v) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, k, v);
    }
    return t;
}

/* The shared object equal to `v` from `pool` (new reference); consumes v. */
static PyObject *shared(PyObject *pool, PyObject *v) {
    if (!v) return NULL;
    PyObject *s = PyDict_SetDefault(pool, v, v);
    Py_XINCREF(s);
    Py_DECREF(v);
    return s;
}

/* small caches keyed by raw bytes: categories and phases */
#define NCACHE 32
typedef struct {
    const unsigned char *s;   /* points into the buffer: valid only during one call */
    Py_ssize_t n;
    PyObject *a, *b;          /* borrowed from the dicts/tuples that hold them */
    Py_ssize_t count;
} Slot;

static Slot *find_slot(Slot *slots, int nslots, const unsigned char *s, Py_ssize_t n) {
    for (int k = 0; k < nslots; k++)
        if (slots[k].n == n && memcmp(slots[k].s, s, n) == 0) return &slots[k];
    return NULL;
}

/* Kept rows repeat a few hundred names: a table keyed by the name's raw bytes gives the shared str,
 * its kernel kind and whether it is a CPU collective without building and hashing a new str. */
#define NAME_SLOTS 4096  /* a power of two */
#define SMALL_DURS 4096
typedef struct {
    const unsigned char *s;   /* in the buffer: valid only during one call */
    Py_ssize_t n;
    PyObject *name;           /* borrowed: the names dict holds it */
    PyObject *kind;           /* borrowed from kinds, NULL until known */
    int comm;                 /* kind is "communication" */
    int cpu_special;          /* -1 unknown; else whether a CPU op of this name is a collective call */
} NameSlot;

typedef struct {
    NameSlot names[NAME_SLOTS];
    PyObject *durs[SMALL_DURS];  /* borrowed from the durs dict */
} Cache;

static NameSlot *name_slot(Cache *cache, const unsigned char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    Py_ssize_t k = 0;
    for (; k + 8 <= n; k += 8) {
        uint64_t w;
        memcpy(&w, s + k, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; k < n; k++) h = (h ^ s[k]) * 0x100000001b3ull;
    h ^= h >> 29;
    for (size_t probe = 0; probe < 64; probe++) {
        NameSlot *slot = &cache->names[(h + probe) & (NAME_SLOTS - 1)];
        if (!slot->name) { slot->cpu_special = -1; return slot; }
        if (slot->n == n && memcmp(slot->s, s, n) == 0) return slot;
    }
    return NULL;  /* crowded: go without the cache */
}

/* pid / tid repeat in runs: the shared object of the last integer seen */
typedef struct {
    long long i;
    PyObject *obj;  /* borrowed from ids */
} LastId;

static PyObject *cached_id(LastId *last, Field *f, PyObject *ids, PyObject *decode_str, PyObject *undecodable,
                           int *leave) {
    if (f->type == T_INT && last->obj && last->i == f->i) {
        Py_INCREF(last->obj);
        return last->obj;
    }
    PyObject *v = checked(value_of(f, decode_str), undecodable, leave);
    v = v ? shared(ids, v) : NULL;
    if (v && f->type == T_INT) { last->i = f->i; last->obj = v; }
    return v;
}

static int append(PyObject *list, PyObject *v) {
    /* steals v */
    if (!v) return -1;
    int r = PyList_Append(list, v);
    Py_DECREF(v);
    return r;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos;
    PyObject *ctx;
    if (!PyArg_ParseTuple(args, "y*nO!", &view, &pos, &PyTuple_Type, &ctx)) return NULL;
    PyObject *cols, *category, *names, *ids, *durs, *kinds, *kernel_kind, *cpu_coll, *cpu_collective, *decode_str,
        *undecodable;
    if (!PyArg_ParseTuple(ctx, "O!OO!O!O!O!OO!OOO", &PyList_Type, &cols, &category, &PyDict_Type, &names,
                          &PyDict_Type, &ids, &PyDict_Type, &durs, &PyDict_Type, &kinds, &kernel_kind,
                          &PyDict_Type, &cpu_coll, &cpu_collective, &decode_str, &undecodable)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (pos < 0 || pos > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: pos outside the buffer");
        return NULL;
    }
    if (PyList_GET_SIZE(cols) != NCOLS) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "cols must hold 17 lists");
        return NULL;
    }
    PyObject *col[NCOLS];
    for (int k = 0; k < NCOLS; k++) {
        col[k] = PyList_GET_ITEM(cols, k);
        if (!PyList_Check(col[k])) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "cols must hold lists");
            return NULL;
        }
    }
    PyObject *specials = PyList_New(0), *metadata = PyList_New(0), *phases = PyDict_New();
    PyObject *cat_results = PyList_New(0);  /* keeps category() results alive for the cache */
    PyObject *ph_keys = PyList_New(0);
    PyObject *result = NULL;
    Slot cats[NCACHE], phs[NCACHE];
    LastId last_pid = {0, NULL}, last_tid = {0, NULL};
    Cache *cache = PyMem_Calloc(1, sizeof(Cache));
    if (!cache) { PyErr_NoMemory(); goto done; }
    int ncats = 0, nphs = 0;
    Py_ssize_t events = 0, no_cat = 0, trace_span = 0, unwanted = 0;
    int why = 0, leave = 0;
    if (!specials || !metadata || !phases || !cat_results || !ph_keys) goto done;

    const unsigned char *base = (const unsigned char *)view.buf;
    Cur c = {base + pos, base + view.len};
    const unsigned char *taken = c.p;
    Event ev;
    memset(&ev, 0, sizeof(ev));  /* once: scan_event resets what it uses */
    for (;;) {
        while (c.p < c.end && (*c.p == ',' || *c.p == ' ' || *c.p == '\n' || *c.p == '\r' || *c.p == '\t')) c.p++;
        taken = c.p;
        if (c.p >= c.end) { why = 0; break; }
        if (*c.p != '{') { why = 1; break; }
        int r = scan_event(&c, &ev);
        if (r == INCOMPLETE) { why = 0; break; }
        if (r != OK) { why = 2; break; }
        /* the element must be followed by a separator or the end of the array */
        {
            const unsigned char *q = c.p;
            while (q < c.end && (*q == ' ' || *q == '\n' || *q == '\r' || *q == '\t')) q++;
            if (q >= c.end) { why = 0; break; }
            if (*q != ',' && *q != ']') { why = 2; break; }
        }
        events++;
        if ((events & 255) == 0) {
            /* Let a waiting thread run (the gzip reader needs the GIL for a moment per chunk). */
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
        /* ph */
        if (!(ev.ph.type == T_STR && ev.ph.n == 1 && ev.ph.s[0] == 'X' && !ev.ph.escaped)) {
            if (ev.ph.type == T_STR && ev.ph.n == 1 && ev.ph.s[0] == 'M' && !ev.ph.escaped) {
                /* (name, pid, tid, args.name): what kineto._Collector._metadata reads */
                PyObject *parts[4] = {NULL, NULL, NULL, NULL};
                int bad = 0;
                for (int k = 0; k < 4 && !bad; k++) {
                    PyObject *v = k == 0 ? str_of(&ev.name, decode_str)
                                  : k == 1 ? value_of(&ev.pid, decode_str)
                                  : k == 2 ? value_of(&ev.tid, decode_str)
                                  : arg_value(&ev.arg[ARG_NAME], 0, decode_str);
                    parts[k] = checked(v, undecodable, &leave);
                    bad = parts[k] == NULL;
                }
                PyObject *m = bad ? NULL : PyTuple_New(4);
                if (!m) {
                    for (int k = 0; k < 4; k++) Py_XDECREF(parts[k]);
                    if (leave) goto leave_event;
                    goto done;
                }
                for (int k = 0; k < 4; k++) PyTuple_SET_ITEM(m, k, parts[k]);
                if (append(metadata, m) < 0) goto done;
            }
            const unsigned char *s = ev.ph.type == T_STR ? ev.ph.s : (const unsigned char *)"";
            Py_ssize_t n = ev.ph.type == T_STR ? ev.ph.n : -1;  /* -1: null or absent */
            Slot *slot = NULL;
            for (int k = 0; k < nphs; k++)
                if (phs[k].n == n && (n < 0 || memcmp(phs[k].s, s, n) == 0)) { slot = &phs[k]; break; }
            if (slot) { slot->count++; continue; }
            PyObject *key = ev.ph.type == T_STR ? str_of(&ev.ph, decode_str) : (Py_INCREF(Py_None), Py_None);
            if (!key) goto done;
            if (PyList_Append(ph_keys, key) < 0) { Py_DECREF(key); goto done; }
            Py_DECREF(key);
            /* every key enters the dict when first seen, so the dict keeps first-seen order; counts of
             * the cached ones are added at the end */
            PyObject *old = PyDict_GetItemWithError(phases, key);
            if (!old && PyErr_Occurred()) goto done;
            PyObject *v = PyLong_FromSsize_t((old ? PyLong_AsSsize_t(old) : 0) + (nphs < NCACHE ? 0 : 1));
            if (!v || PyDict_SetItem(phases, key, v) < 0) { Py_XDECREF(v); goto done; }
            Py_DECREF(v);
            if (nphs < NCACHE) {
                phs[nphs].s = s; phs[nphs].n = n; phs[nphs].a = key; phs[nphs].b = NULL; phs[nphs].count = 1;
                nphs++;
            }
            continue;
        }
        if (ev.cat.type != T_STR || ev.ts.type <= T_NULL || ev.dur.type <= T_NULL) { no_cat++; continue; }
        /* category */
        PyObject *canon, *cpu_cat;
        Slot *cs = ev.cat.escaped ? NULL : find_slot(cats, ncats, ev.cat.s, ev.cat.n);
        if (cs) {
            canon = cs->a; cpu_cat = cs->b;
        } else {
            PyObject *catstr = checked(str_of(&ev.cat, decode_str), undecodable, &leave);
            if (!catstr) { if (leave) goto leave_event; goto done; }
            int is_trace = PyUnicode_CompareWithASCIIString(catstr, "Trace") == 0;
            PyObject *res = is_trace ? (Py_INCREF(Py_None), Py_None) : PyObject_CallOneArg(category, catstr);
            Py_DECREF(catstr);
            if (!res) goto done;
            if (PyList_Append(cat_results, res) < 0) { Py_DECREF(res); goto done; }
            Py_DECREF(res);
            if (is_trace) { canon = NULL; cpu_cat = NULL; }
            else {
                if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2) {
                    PyErr_SetString(PyExc_TypeError, "category() must return a pair");
                    goto done;
                }
                canon = PyTuple_GET_ITEM(res, 0); cpu_cat = PyTuple_GET_ITEM(res, 1);
            }
            if (!ev.cat.escaped && ncats < NCACHE) {
                cats[ncats].s = ev.cat.s; cats[ncats].n = ev.cat.n; cats[ncats].a = canon; cats[ncats].b = cpu_cat;
                ncats++;
            }
        }
        if (!canon) { trace_span++; continue; }
        if (canon == Py_None) { unwanted++; continue; }
        /* a kept row: every value is made first, so an event left to the Python path adds nothing */
        {
            PyObject *vals[NROW] = {NULL};
            NameSlot *ns = ev.name.type == T_STR && !ev.name.escaped ? name_slot(cache, ev.name.s, ev.name.n) : NULL;
            PyObject *name;
            if (ns && ns->name) name = Py_NewRef(ns->name);
            else {
                name = checked(str_of(&ev.name, decode_str), undecodable, &leave);
                name = name ? shared(names, name) : NULL;
            }
            if (!name) { if (leave) goto leave_event; goto done; }
            if (ns && !ns->name) { ns->s = ev.name.s; ns->n = ev.name.n; ns->name = name; }  /* names holds it */
            vals[R_NAME] = name;
            int special = 0;
            PyObject *kind = Py_None;
            int gpu = ev.stream.type == T_INT && ev.stream.i != -1;
            if (gpu) {
                kind = ns ? ns->kind : NULL;
                if (!kind) {
                    kind = PyDict_GetItemWithError(kinds, name);
                    if (!kind) {
                        if (PyErr_Occurred()) goto row_failed;
                        PyObject *k = PyObject_CallOneArg(kernel_kind, name);
                        if (!k || PyDict_SetItem(kinds, name, k) < 0) { Py_XDECREF(k); goto row_failed; }
                        Py_DECREF(k);
                        kind = PyDict_GetItemWithError(kinds, name);
                        if (!kind) goto row_failed;
                    }
                    if (ns) {
                        ns->kind = kind;  /* kinds holds it */
                        ns->comm = PyUnicode_CompareWithASCIIString(kind, "communication") == 0;
                    }
                }
                special = ns ? ns->comm : PyUnicode_CompareWithASCIIString(kind, "communication") == 0;
            } else if (cpu_cat == Py_True) {
                if (ns && ns->cpu_special >= 0) special = ns->cpu_special;
                else {
                    if (PyUnicode_CompareWithASCIIString(name, "record_param_comms") == 0) special = 1;
                    else {
                        PyObject *coll = PyDict_GetItemWithError(cpu_coll, name);
                        if (!coll) {
                            if (PyErr_Occurred()) goto row_failed;
                            coll = PyObject_CallOneArg(cpu_collective, name);
                            if (!coll) goto row_failed;
                            Py_DECREF(coll);  /* cpu_collective stores it in cpu_coll */
                        }
                        special = coll != Py_None;
                    }
                    if (ns) ns->cpu_special = special;
                }
            }
            vals[R_KIND] = Py_NewRef(kind);
            vals[R_CAT] = Py_NewRef(canon);
            if (!(vals[R_PID] = cached_id(&last_pid, &ev.pid, ids, decode_str, undecodable, &leave))) goto row_failed;
            if (!(vals[R_TID] = cached_id(&last_tid, &ev.tid, ids, decode_str, undecodable, &leave))) goto row_failed;
            if (ev.dur.type == T_INT && ev.dur.i >= 0 && ev.dur.i < SMALL_DURS) {
                PyObject *dur = cache->durs[ev.dur.i];
                if (dur) Py_INCREF(dur);
                else if ((dur = shared(durs, PyLong_FromLongLong(ev.dur.i)))) cache->durs[ev.dur.i] = dur;  /* durs holds it */
                vals[R_DUR] = dur;
            } else vals[R_DUR] = shared(durs, value_of(&ev.dur, decode_str));
            vals[R_STREAM] = value_of(&ev.stream, decode_str);
            vals[R_TS] = value_of(&ev.ts, decode_str);
            vals[R_CORR] = value_of(&ev.corr, decode_str);
            if (!vals[R_DUR] || !vals[R_STREAM] || !vals[R_TS] || !vals[R_CORR]) goto row_failed;
            if (special && !(vals[R_ARGS] = args_tuple(&ev, decode_str, undecodable, &leave))) goto row_failed;
            /* rank and the columns filled later (collective ... step, launch_ts) are padded by the caller */
            Py_ssize_t row = PyList_GET_SIZE(col[C_CAT]);
            static const int target[NROW - 1] = {C_PID, C_TID, C_STREAM, C_CAT, C_NAME, C_TS, C_DUR, C_KIND, C_CORR};
            int failed = 0;
            for (int k = 0; k < NROW - 1 && !failed; k++) failed = PyList_Append(col[target[k]], vals[k]) < 0;
            if (!failed && special) {
                PyObject *sp = Py_BuildValue("(nO)", row, vals[R_ARGS]);
                failed = append(specials, sp) < 0;
            }
            for (int k = 0; k < NROW; k++) Py_XDECREF(vals[k]);
            if (failed) goto done;
            continue;
        row_failed:
            for (int k = 0; k < NROW; k++) Py_XDECREF(vals[k]);
            if (leave) goto leave_event;
            goto done;
        }
    leave_event:
        /* a value only msgspec can decode (it refused it): the Python path takes this event */
        leave = 0;
        events--;
        why = 2;
        break;
    }
    for (int k = 0; k < nphs; k++) {
        PyObject *old = PyDict_GetItemWithError(phases, phs[k].a);
        if (!old && PyErr_Occurred()) goto done;
        PyObject *v = PyLong_FromSsize_t((old ? PyLong_AsSsize_t(old) : 0) + phs[k].count);
        if (!v || PyDict_SetItem(phases, phs[k].a, v) < 0) { Py_XDECREF(v); goto done; }
        Py_DECREF(v);
    }
    result = Py_BuildValue("(ninNNNnnn)", (Py_ssize_t)(taken - base), why, events, specials, metadata, phases,
                           no_cat, trace_span, unwanted);
    specials = metadata = phases = NULL;  /* stolen by N */
done:
    Py_XDECREF(specials);
    Py_XDECREF(metadata);
    Py_XDECREF(phases);
    Py_XDECREF(cat_results);
    Py_XDECREF(ph_keys);
    PyMem_Free(cache);
    PyBuffer_Release(&view);
    return result;
}

/* untrack_scalar_lists(lists) -> number untracked: take lists that hold no GC-tracked object out of
 * the cyclic collector. A table's columns are lists of hundreds of thousands of ints, floats and
 * strs; they cannot be part of a cycle, yet every collection after the parse walked all their items
 * (several ms per collection, and once more at interpreter exit). A list that holds any tracked
 * object stays tracked. */
static PyObject *untrack_scalar_lists(PyObject *self, PyObject *lists) {
    PyObject *it = PyObject_GetIter(lists);
    if (!it) return NULL;
    Py_ssize_t done = 0;
    PyObject *obj;
    while ((obj = PyIter_Next(it))) {
        if (PyList_CheckExact(obj) && PyObject_GC_IsTracked(obj)) {
            Py_ssize_t n = PyList_GET_SIZE(obj), k = 0;
            for (; k < n; k++) {
                PyObject *v = PyList_GET_ITEM(obj, k);
                if (PyObject_IS_GC(v) && PyObject_GC_IsTracked(v)) break;
            }
            if (k == n) {
                PyObject_GC_UnTrack(obj);
                done++;
            }
        }
        Py_DECREF(obj);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(done);
}

/* The exact double of an int or float, or 0 when there is none (an int beyond 2**53, another type). */
static int exact_double(PyObject *v, double *out) {
    if (PyFloat_CheckExact(v)) { *out = PyFloat_AS_DOUBLE(v); return 1; }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x > (1LL << 53) || x < -(1LL << 53)) { PyErr_Clear(); return 0; }
        *out = (double)x;
        return 1;
    }
    return 0;
}

/* assign_steps(ts, stream, corr, steps, launch_ts, spans, reach, disjoint) -> bool
 * The row loop of kineto._assign_steps, same rules (see there): CPU rows take the ProfilerStep span
 * containing their start (the last containing one wins), GPU rows (stream set and not -1) the step
 * and the earliest start of the CPU rows with their correlation. `spans` is the sorted list of
 * (start, end, N), `reach[k]` the latest end among spans[0..k]. Returns False when some time is not
 * an int within 2**53 or a float, or some correlation not a 64-bit int: the Python loop then runs
 * (and rewrites every value this may have set). */
typedef struct {
    long long corr;
    Py_ssize_t row;
} Launch;

static int cmp_launch(const void *x, const void *y) {
    const Launch *p = x, *q = y;
    if (p->corr != q->corr) return p->corr < q->corr ? -1 : 1;
    return p->row < q->row ? -1 : p->row > q->row;
}

static PyObject *assign_steps(PyObject *self, PyObject *args) {
    PyObject *ts, *stream, *corr, *steps, *launch_ts, *spans, *reach;
    int disjoint;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!p", &PyList_Type, &ts, &PyList_Type, &stream, &PyList_Type, &corr,
                          &PyList_Type, &steps, &PyList_Type, &launch_ts, &PyList_Type, &spans, &PyList_Type,
                          &reach, &disjoint))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ts), ns = PyList_GET_SIZE(spans);
    if (PyList_GET_SIZE(stream) != n || PyList_GET_SIZE(corr) != n || PyList_GET_SIZE(steps) != n
        || PyList_GET_SIZE(launch_ts) != n || PyList_GET_SIZE(reach) != ns) {
        PyErr_SetString(PyExc_ValueError, "assign_steps: lists of different lengths");
        return NULL;
    }
    PyObject *result = NULL;
    double *t = PyMem_Malloc(sizeof(double) * (n + 3 * ns + 1));
    Py_ssize_t *gpu = PyMem_Malloc(sizeof(Py_ssize_t) * (n + 1));
    long long *gcorr = PyMem_Malloc(sizeof(long long) * (n + 1));
    Launch *launch = PyMem_Malloc(sizeof(Launch) * (n + 1));
    PyObject **rowstep = PyMem_Malloc(sizeof(PyObject *) * (n + 1));  /* borrowed: None or a span's N */
    if (!t || !gpu || !gcorr || !launch || !rowstep) { PyErr_NoMemory(); goto done; }
    double *start = t + n, *end = start + ns, *rch = end + ns;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!exact_double(PyList_GET_ITEM(ts, i), &t[i])) { result = Py_NewRef(Py_False); goto done; }
    for (Py_ssize_t k = 0; k < ns; k++) {
        PyObject *sp = PyList_GET_ITEM(spans, k);
        if (!PyTuple_Check(sp) || PyTuple_GET_SIZE(sp) != 3 || !exact_double(PyTuple_GET_ITEM(sp, 0), &start[k])
            || !exact_double(PyTuple_GET_ITEM(sp, 1), &end[k]) || !exact_double(PyList_GET_ITEM(reach, k), &rch[k])) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    /* Correlations are matched by sorting (corr, row) pairs rather than through dicts: two dicts of
     * every launch were the parse's peak memory. Correlations that are not 64-bit ints: the Python. */
    Py_ssize_t ngpu = 0, nlaunch = 0;
    int have = 0;               /* lo, hi, current valid (disjoint spans: the run the previous row fell in) */
    double lo = 0, hi = 0;
    PyObject *current = Py_None;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = PyList_GET_ITEM(stream, i), *c = PyList_GET_ITEM(corr, i);
        long long cv = 0;
        if (c != Py_None) {
            int overflow = 0;
            if (!PyLong_CheckExact(c)) { result = Py_NewRef(Py_False); goto done; }
            cv = PyLong_AsLongLongAndOverflow(c, &overflow);
            if (overflow) { result = Py_NewRef(Py_False); goto done; }
            if (cv == -1 && PyErr_Occurred()) goto done;
        }
        if (st != Py_None) {
            int overflow = 0;
            long v = PyLong_Check(st) ? PyLong_AsLongAndOverflow(st, &overflow) : 0;
            if (!PyLong_Check(st) || overflow || v != -1) {
                if (PyErr_Occurred()) goto done;
                if (c != Py_None) { gpu[ngpu] = i; gcorr[ngpu] = cv; ngpu++; }
                continue;
            }
        }
        double x = t[i];
        PyObject *step = Py_None;
        if (have && lo <= x && x < hi) step = current;
        else {
            /* bisect_right(start, x) - 1 */
            Py_ssize_t a = 0, b = ns;
            while (a < b) {
                Py_ssize_t mid = (a + b) / 2;
                if (x < start[mid]) b = mid; else a = mid + 1;
            }
            for (Py_ssize_t k = a - 1; k >= 0 && rch[k] > x; k--) {
                if (x < end[k]) {
                    step = PyTuple_GET_ITEM(PyList_GET_ITEM(spans, k), 2);
                    if (disjoint) { have = 1; lo = start[k]; hi = end[k]; current = step; }
                    break;
                }
            }
        }
        Py_INCREF(step);
        PyList_SetItem(steps, i, step);
        rowstep[i] = step;
        if (c != Py_None) { launch[nlaunch].corr = cv; launch[nlaunch].row = i; nlaunch++; }
    }
    /* per correlation: the step of its last CPU row (the dict's last write) and the start of its
     * earliest one (the first row among equal starts); keys written over the sorted pairs in place */
    qsort(launch, nlaunch, sizeof(Launch), cmp_launch);
    Py_ssize_t nkeys = 0;
    for (Py_ssize_t j = 0; j < nlaunch;) {
        Py_ssize_t k = j, first = launch[j].row;
        long long key = launch[j].corr;
        for (; k < nlaunch && launch[k].corr == key; k++)
            if (t[launch[k].row] < t[first]) first = launch[k].row;
        Py_ssize_t last = launch[k - 1].row;
        launch[nkeys].corr = key;
        launch[nkeys].row = last;
        /* remember the earliest row in the spare upper half of gcorr (nkeys <= j < n) */
        gcorr[ngpu + nkeys] = first;
        nkeys++;
        j = k;
    }
    for (Py_ssize_t g = 0; g < ngpu; g++) {
        long long key = gcorr[g];
        Py_ssize_t a = 0, b = nkeys;
        while (a < b) {
            Py_ssize_t mid = (a + b) / 2;
            if (launch[mid].corr < key) a = mid + 1; else b = mid;
        }
        if (a >= nkeys || launch[a].corr != key) continue;  /* launched before the trace began */
        Py_ssize_t i = gpu[g];
        PyObject *step = rowstep[launch[a].row], *at = PyList_GET_ITEM(ts, (Py_ssize_t)gcorr[ngpu + a]);
        Py_INCREF(step);
        PyList_SetItem(steps, i, step);
        Py_INCREF(at);
        PyList_SetItem(launch_ts, i, at);
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(t);
    PyMem_Free(gpu);
    PyMem_Free(gcorr);
    PyMem_Free(launch);
    PyMem_Free(rowstep);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* interval helpers of analysis.analyzers.trace_analysis: same results, objects and order as the Python */

typedef struct {
    double a, b;       /* merge: start, end; sweep: time, unused */
    Py_ssize_t seq;    /* input position: equal keys keep it, as Python's stable sort */
} Key;

static int cmp_interval(const void *x, const void *y) {
    const Key *p = x, *q = y;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    if (p->b != q->b) return p->b < q->b ? -1 : 1;
    return p->seq < q->seq ? -1 : p->seq > q->seq;
}

static int cmp_time(const void *x, const void *y) {
    const Key *p = x, *q = y;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    return p->seq < q->seq ? -1 : p->seq > q->seq;
}

/* hta_merge(intervals) -> merged list, or None when some bound is not an exact double (the Python
 * runs then). trace_analysis._hta_merge: sort by (start, end); a new block when a start lies after
 * every earlier end; each block is (its first start, its largest end) as the original objects. */
static PyObject *hta_merge(PyObject *self, PyObject *intervals) {
    if (!PyList_Check(intervals)) { PyErr_SetString(PyExc_TypeError, "hta_merge: a list"); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(intervals);
    Key *k = PyMem_Malloc(sizeof(Key) * (n + 1));
    if (!k) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *iv = PyList_GET_ITEM(intervals, i);
        if (!PyTuple_Check(iv) || PyTuple_GET_SIZE(iv) != 2 || !exact_double(PyTuple_GET_ITEM(iv, 0), &k[i].a)
            || !exact_double(PyTuple_GET_ITEM(iv, 1), &k[i].b) || k[i].a != k[i].a || k[i].b != k[i].b) {
            PyMem_Free(k);
            Py_RETURN_NONE;
        }
        k[i].seq = i;
    }
    qsort(k, n, sizeof(Key), cmp_interval);
    PyObject *out = PyList_New(0);
    if (!out) { PyMem_Free(k); return NULL; }
    double reach = -Py_HUGE_VAL, ce = 0;
    PyObject *cs_obj = NULL, *ce_obj = NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *iv = PyList_GET_ITEM(intervals, k[j].seq);
        double s = k[j].a, e = k[j].b;
        if (s > reach) {
            if (cs_obj) {
                PyObject *t = PyTuple_Pack(2, cs_obj, ce_obj);
                if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); goto fail; }
                Py_DECREF(t);
            }
            cs_obj = PyTuple_GET_ITEM(iv, 0);
            ce_obj = PyTuple_GET_ITEM(iv, 1);
            ce = e;
        } else if (e > ce) {
            ce_obj = PyTuple_GET_ITEM(iv, 1);
            ce = e;
        }
        if (e > reach) reach = e;
    }
    if (cs_obj) {
        PyObject *t = PyTuple_Pack(2, cs_obj, ce_obj);
        if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    /* the Python sorts its argument in place; callers pass fresh lists and do not look again */
    PyMem_Free(k);
    return out;
fail:
    PyMem_Free(k);
    Py_DECREF(out);
    return NULL;
}

/* sweep(groups) -> {state: time}, or None when it cannot be exact (the Python runs then).
 * trace_analysis._sweep: +bit at each block start, -bit at each end, events stably sorted by time,
 * the running state held until the next event; states in order of first appearance. */
static PyObject *sweep(PyObject *self, PyObject *groups) {
    if (!PyList_Check(groups)) { PyErr_SetString(PyExc_TypeError, "sweep: a list"); return NULL; }
    Py_ssize_t ng = PyList_GET_SIZE(groups), n = 0;
    if (ng > 8) Py_RETURN_NONE;
    for (Py_ssize_t g = 0; g < ng; g++) {
        PyObject *blocks = PyList_GET_ITEM(groups, g);
        if (!PyList_Check(blocks)) Py_RETURN_NONE;
        n += 2 * PyList_GET_SIZE(blocks);
    }
    Key *k = PyMem_Malloc(sizeof(Key) * (n + 1));
    long *delta = PyMem_Malloc(sizeof(long) * (n + 1));
    if (!k || !delta) { PyMem_Free(k); PyMem_Free(delta); return PyErr_NoMemory(); }
    Py_ssize_t m = 0;
    for (Py_ssize_t g = 0; g < ng; g++) {
        PyObject *blocks = PyList_GET_ITEM(groups, g);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
            PyObject *iv = PyList_GET_ITEM(blocks, i);
            double s, e;
            if (!PyTuple_Check(iv) || PyTuple_GET_SIZE(iv) != 2 || !exact_double(PyTuple_GET_ITEM(iv, 0), &s)
                || !exact_double(PyTuple_GET_ITEM(iv, 1), &e) || s != s || e != e) {
                PyMem_Free(k);
                PyMem_Free(delta);
                Py_RETURN_NONE;
            }
            k[m].a = s; k[m].b = 0; k[m].seq = m; delta[m] = 1L << g; m++;
            k[m].a = e; k[m].b = 0; k[m].seq = m; delta[m] = -(1L << g); m++;
        }
    }
    qsort(k, n, sizeof(Key), cmp_time);
    double total[256] = {0};
    int order[256], seen[256] = {0}, norder = 0;
    long state = 0;
    for (Py_ssize_t j = 0; j + 1 < n; j++) {
        state += delta[k[j].seq];
        if (state >= 256) {  /* overlapping blocks within a group: the Python handles any state */
            PyMem_Free(k);
            PyMem_Free(delta);
            Py_RETURN_NONE;
        }
        if (state > 0) {
            if (!seen[state]) { seen[state] = 1; order[norder++] = (int)state; }
            total[state] += k[j + 1].a - k[j].a;
        }
    }
    PyMem_Free(k);
    PyMem_Free(delta);
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (int j = 0; j < norder; j++) {
        PyObject *key = PyLong_FromLong(order[j]), *val = PyFloat_FromDouble(total[order[j]]);
        if (!key || !val || PyDict_SetItem(out, key, val) < 0) {
            Py_XDECREF(key); Py_XDECREF(val); Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key); Py_DECREF(val);
    }
    return out;
}

/* rows_where(column, test, value) -> [row numbers]: the rows of a column list whose item passes one test, the
 * selections the analyses make over a table's columns (kineto.rows_not / rows_equal / rows_in; map +
 * itertools.compress costs about 50 ns a row on a small CPU, this loop a few). test 0: item is not value;
 * 1: item == value; 2: item in value (a dict, set or frozenset; kineto passes only plain dicts). */
static PyObject *rows_where(PyObject *self, PyObject *args) {
    PyObject *col, *value;
    int test;
    if (!PyArg_ParseTuple(args, "O!iO", &PyList_Type, &col, &test, &value)) return NULL;
    if (test < 0 || test > 2 || (test == 2 && !PyDict_Check(value) && !PyAnySet_Check(value))) {
        PyErr_SetString(PyExc_TypeError, "rows_where: test 0 (is not), 1 (==) or 2 (in a dict or set)");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(col); i++) {
        PyObject *v = PyList_GET_ITEM(col, i);
        int hit;
        if (test == 0) {
            hit = v != value;
        } else {
            Py_INCREF(v);  /* an __eq__ or __hash__ of Python code could change the list */
            if (test == 1) {
                /* as operator.eq: no identity shortcut (nan != nan), except for a str, which equals itself */
                PyObject *r = v == value && PyUnicode_CheckExact(v) ? Py_NewRef(Py_True)
                                                                    : PyObject_RichCompare(v, value, Py_EQ);
                hit = r ? PyObject_IsTrue(r) : -1;
                Py_XDECREF(r);
            } else {
                hit = PyDict_Check(value) ? PyDict_Contains(value, v) : PySet_Contains(value, v);
            }
            Py_DECREF(v);
        }
        if (hit < 0) { Py_DECREF(out); return NULL; }
        if (hit) {
            PyObject *k = PyLong_FromSsize_t(i);
            if (!k || PyList_Append(out, k) < 0) { Py_XDECREF(k); Py_DECREF(out); return NULL; }
            Py_DECREF(k);
        }
    }
    return out;
}

/* A double that holds the int or float exactly and whose sums with another such stay exact (|int| <= 2**52),
 * and is not NaN; else 0. */
static int bounded_double(PyObject *v, double *out) {
    if (!exact_double(v, out) || *out != *out) return 0;
    return !PyLong_CheckExact(v) || (*out <= 4503599627370496.0 && *out >= -4503599627370496.0);
}

/* time_bounds(ts, dur) -> (i_min_ts, i_max_ts, i_min_dur, i_max_dur, i_max_end, any_float), or None when some
 * value is not a bounded double (the Python runs then). Row numbers of the first smallest / largest start,
 * duration and end (ts + dur), as min() and max() pick them, so the caller reads the original objects; any_float:
 * some start is a float. One pass where min(), max() and any() make six over a table's two longest columns. */
static PyObject *time_bounds(PyObject *self, PyObject *args) {
    PyObject *ts, *dur;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &ts, &PyList_Type, &dur)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ts);
    if (n == 0 || PyList_GET_SIZE(dur) != n) Py_RETURN_NONE;
    Py_ssize_t imin = 0, imax = 0, dmin = 0, dmax = 0, emax = 0;
    double lo = 0, hi = 0, dlo = 0, dhi = 0, ehi = 0;
    int any_float = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(ts, i), *d = PyList_GET_ITEM(dur, i);
        double a, b;
        if (!bounded_double(t, &a) || !bounded_double(d, &b)) Py_RETURN_NONE;
        any_float |= PyFloat_CheckExact(t);
        double e = a + b;
        if (i == 0) { lo = hi = a; dlo = dhi = b; ehi = e; continue; }
        if (a < lo) { lo = a; imin = i; }
        if (a > hi) { hi = a; imax = i; }
        if (b < dlo) { dlo = b; dmin = i; }
        if (b > dhi) { dhi = b; dmax = i; }
        if (e > ehi) { ehi = e; emax = i; }
    }
    return Py_BuildValue("nnnnnO", imin, imax, dmin, dmax, emax, any_float ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"rows_where", rows_where, METH_VARARGS, "kineto.rows_where in C (see the C source)."},
    {"time_bounds", time_bounds, METH_VARARGS, "kineto.time_bounds in C (see the C source)."},
    {"hta_merge", hta_merge, METH_O, "trace_analysis._hta_merge in C (see the C source)."},
    {"sweep", sweep, METH_O, "trace_analysis._sweep in C (see the C source)."},
    {"assign_steps", assign_steps, METH_VARARGS, "The row loop of kineto._assign_steps (see the C source)."},
    {"scan", scan, METH_VARARGS, "Scan complete Kineto events from a buffer into column lists (see the C source)."},
    {"untrack_scalar_lists", untrack_scalar_lists, METH_O,
     "untrack_scalar_lists(lists) -> count: take lists holding no GC-tracked object out of the cyclic GC"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kscan", "Fast path of analysis.parsers.kineto.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kscan(void) {
    init_tables();
    return PyModule_Create(&module);
}
