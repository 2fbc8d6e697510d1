/* skillstats._native: the per-record hot path in C (decode's fast path, the windows and docsync folds).

Why C, and why only this: on a backfill a windows worker spent about 1.9 CPU
seconds per million records in decode_many's Python loop (a msgspec decode,
then a dozen checks and a StatEvent per record) and 1.3 in the fold, a third
of its CPU (docs/performance.md, "Where each CPU second goes"). Both are a
few comparisons per record that the interpreter runs at ~50 ns a bytecode.

What it may decide is deliberately small, so that its correctness is a matter
of reading it:

- `decode_valid` ACCEPTS records and never rejects one. It reads a strict
  subset of JSON (an object of the contract's members, each exactly once, with
  printable-ASCII strings without escapes and integers without fraction or
  exponent, whitespace anywhere JSON allows it) and applies the contract's
  checks (docs/contract.md). A record it cannot prove valid that way comes back
  in `pending`, and skillstats.contract decides it with the same code as
  before: the Python fast path, then the reference. Every record it accepts is
  one the reference (orjson + from_mapping) accepts with the same fields;
  tests/test_native.py checks that against the reference on the hostile corpus
  and on generated records, and that the verdicts of decode_many are the same
  with and without this module.
- `window_rows` is sinks/windows.py's `fold_rows`: the windows' rows in key
  order for the upserts, the same as `rows_of(fold(...))` in Python; and
  `fold_skills` the loop of sinks/docstats.py's `PartitionDeltas.add_decoded`.
- `WindowFold` is the same fold over a batch given piece by piece, and what
  the windows worker's decode feeds (sinks/pipeline.py `decode_batch`): the
  records `decode_valid` would take are added from their bytes, with no event
  built (as `fold_records` does for docsync), the others' events as
  `window_rows` adds them; `window_rows` is one of these fed only events.
- `batch_columns` is streams/aiokafka_records.py's Python loop over a record
  batch, `_columns_from`: a v2 batch's records from a position on, read from its
  bytes into the drain's columns, where aiokafka built a record object each.

The folds take a snapshot of the events they are handed (a tuple): reading an
attribute of something that is not a StatEvent can run Python code, and a
list changed under a loop over its borrowed items would be read after free.
The docsync fold's counts add as Python ints do, past 64 bits too (its deltas
come from the records). The windows rows add the kinds' fixed effects in C
ints: a batch's sum is at most its length, and one past 64 bits (unreachable)
raises OverflowError rather than wrap.

The cost: a compiler at install time (gcc and the Python headers; the image's
build stage installs them), and a second implementation of a few small things,
kept honest by the differential tests. Without the module (an install that
could not build it, or SKILLSTATS_PURE_PYTHON=1) skillstats.contract and the
sinks run their Python paths: the same verdicts and counts, more CPU per event.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 "unknown"
#endif

/* The contract's limits, handed over by configure() from skillstats.contract, their one place: a changed
   limit can never leave this reader judging by the old one. */
static long long WIRE_VERSION, MAX_VALUE_BYTES, MAX_ID_CHARS, MAX_ABS_DELTA, EPOCH_2000_MS, MAX_OCCURRED_AT_MS,
    MAX_FUTURE_SKEW_MS;
#define MS_PER_HOUR 3600000LL
#define MS_PER_DAY 86400000LL
#define MAX_KINDS 32

typedef struct {
    const char *bytes;
    Py_ssize_t length;
    PyObject *name; /* the str the contract's table holds: every event of a kind shares it */
    int uses_delta;
} Kind;

static PyObject *event_type = NULL; /* skillstats.contract.StatEvent */
static Kind kinds[MAX_KINDS];
static int kind_count = 0;

/* ---- the strict reader ---------------------------------------------------------------- */

typedef struct {
    const unsigned char *at;
    const unsigned char *end;
} Reader;

static inline void skip_ws(Reader *r) {
    while (r->at < r->end && (*r->at == ' ' || *r->at == '\t' || *r->at == '\n' || *r->at == '\r'))
        r->at++;
}

/* A string of printable ASCII without escapes: its bytes (quotes excluded). 0 if not one. */
static inline int read_plain_string(Reader *r, const unsigned char **start, Py_ssize_t *length) {
    if (r->at >= r->end || *r->at != '"')
        return 0;
    const unsigned char *p = ++r->at;
    while (p < r->end) {
        unsigned char c = *p;
        if (c == '"') {
            *start = r->at;
            *length = p - r->at;
            r->at = p + 1;
            return 1;
        }
        if (c < 0x20 || c > 0x7e || c == '\\')
            return 0; /* an escape, a control character or non-ASCII: the Python paths decide */
        p++;
    }
    return 0;
}

/* An integer literal of at most 18 digits, not followed by a fraction or an exponent. 0 if not one. */
static inline int read_integer(Reader *r, long long *out) {
    const unsigned char *p = r->at;
    int negative = 0;
    if (p < r->end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= r->end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0' && p + 1 < r->end && p[1] >= '0' && p[1] <= '9')
        return 0; /* a leading zero: not JSON */
    long long value = 0;
    int digits = 0;
    while (p < r->end && *p >= '0' && *p <= '9') {
        if (++digits > 18)
            return 0;
        value = value * 10 + (*p - '0');
        p++;
    }
    if (p < r->end && (*p == '.' || *p == 'e' || *p == 'E'))
        return 0;
    r->at = p;
    *out = negative ? -value : value;
    return 1;
}

static inline int expect(Reader *r, unsigned char c) {
    skip_ws(r);
    if (r->at < r->end && *r->at == c) {
        r->at++;
        return 1;
    }
    return 0;
}

static inline int name_is(const unsigned char *s, Py_ssize_t n, const char *name) {
    return (Py_ssize_t)strlen(name) == n && memcmp(s, name, (size_t)n) == 0;
}

enum { F_V = 1, F_EVENT_ID = 2, F_SKILL_ID = 4, F_KIND = 8, F_OCCURRED_AT = 16, F_DELTA = 32 };
#define F_REQUIRED (F_V | F_EVENT_ID | F_SKILL_ID | F_KIND | F_OCCURRED_AT)

typedef struct {
    long long v, occurred_at, all_time, current;
    const unsigned char *event_id, *skill_id, *kind;
    Py_ssize_t event_id_len, skill_id_len, kind_len;
    int seen;
} Wire;

/* `{"all_time": int, "current": int}`, each once, nothing else. */
static int read_delta(Reader *r, Wire *w) {
    int seen = 0;
    if (!expect(r, '{'))
        return 0;
    for (;;) {
        const unsigned char *name;
        Py_ssize_t n;
        skip_ws(r);
        if (!read_plain_string(r, &name, &n) || !expect(r, ':'))
            return 0;
        skip_ws(r);
        if (name_is(name, n, "all_time") && !(seen & 1)) {
            if (!read_integer(r, &w->all_time))
                return 0;
            seen |= 1;
        } else if (name_is(name, n, "current") && !(seen & 2)) {
            if (!read_integer(r, &w->current))
                return 0;
            seen |= 2;
        } else {
            return 0;
        }
        if (expect(r, '}'))
            return seen == 3;
        if (!expect(r, ','))
            return 0;
    }
}

/* The whole value as one object of the contract's members, each once. 0: the Python paths decide. */
static int read_wire(const unsigned char *bytes, Py_ssize_t size, Wire *w) {
    Reader r = {bytes, bytes + size};
    w->seen = 0;
    if (!expect(&r, '{'))
        return 0;
    for (;;) {
        const unsigned char *name;
        Py_ssize_t n;
        int field;
        skip_ws(&r);
        if (!read_plain_string(&r, &name, &n) || !expect(&r, ':'))
            return 0;
        skip_ws(&r);
        if (name_is(name, n, "v"))
            field = F_V;
        else if (name_is(name, n, "event_id"))
            field = F_EVENT_ID;
        else if (name_is(name, n, "skill_id"))
            field = F_SKILL_ID;
        else if (name_is(name, n, "kind"))
            field = F_KIND;
        else if (name_is(name, n, "occurred_at"))
            field = F_OCCURRED_AT;
        else if (name_is(name, n, "delta"))
            field = F_DELTA;
        else
            return 0; /* a member the contract does not name: valid perhaps, the reference decides */
        if (w->seen & field)
            return 0; /* named twice: malformed, the reference says so */
        w->seen |= field;
        int ok;
        switch (field) {
        case F_V:
            ok = read_integer(&r, &w->v);
            break;
        case F_EVENT_ID:
            ok = read_plain_string(&r, &w->event_id, &w->event_id_len);
            break;
        case F_SKILL_ID:
            ok = read_plain_string(&r, &w->skill_id, &w->skill_id_len);
            break;
        case F_KIND:
            ok = read_plain_string(&r, &w->kind, &w->kind_len);
            break;
        case F_OCCURRED_AT:
            ok = read_integer(&r, &w->occurred_at);
            break;
        default:
            ok = read_delta(&r, w);
        }
        if (!ok)
            return 0;
        if (expect(&r, '}'))
            break;
        if (!expect(&r, ','))
            return 0;
    }
    skip_ws(&r);
    return r.at == r.end && (w->seen & F_REQUIRED) == F_REQUIRED;
}

static PyObject *ascii_str(const unsigned char *bytes, Py_ssize_t length) {
    PyObject *s = PyUnicode_New(length, 127);
    if (s != NULL)
        memcpy(PyUnicode_DATA(s), bytes, (size_t)length);
    return s;
}

/* 1 when this module can prove one record valid (`w` read and `*kind_out` its kind), 0 when it leaves it to the
   Python paths. Never raises: what it cannot read is not its to judge. decode_one and fold_records share it, so
   the two cannot take different records. */
static int check_one(PyObject *key, PyObject *value, PyObject *timestamp, Wire *wire, const Kind **kind_out) {
    if (!PyBytes_CheckExact(value) || !PyBytes_CheckExact(key))
        return 0;
    Py_ssize_t size = PyBytes_GET_SIZE(value);
    if (size > MAX_VALUE_BYTES)
        return 0;
    Wire w = {0};
    if (!read_wire((const unsigned char *)PyBytes_AS_STRING(value), size, &w))
        return 0;
    if (w.v != WIRE_VERSION || w.event_id_len < 1 || w.event_id_len > MAX_ID_CHARS || w.skill_id_len < 1 ||
        w.skill_id_len > MAX_ID_CHARS)
        return 0;
    if (PyBytes_GET_SIZE(key) != w.skill_id_len || memcmp(PyBytes_AS_STRING(key), w.skill_id, (size_t)w.skill_id_len))
        return 0;
    const Kind *kind = NULL;
    for (int i = 0; i < kind_count; i++) {
        if (kinds[i].length == w.kind_len && memcmp(kinds[i].bytes, w.kind, (size_t)w.kind_len) == 0) {
            kind = &kinds[i];
            break;
        }
    }
    if (kind == NULL)
        return 0;
    if (w.occurred_at < EPOCH_2000_MS || w.occurred_at > MAX_OCCURRED_AT_MS)
        return 0;
    if (timestamp != Py_None) {
        if (!PyLong_CheckExact(timestamp))
            return 0;
        int overflow = 0;
        long long stamp = PyLong_AsLongLongAndOverflow(timestamp, &overflow);
        if (overflow != 0 || (stamp == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (stamp >= 0 && w.occurred_at - MAX_FUTURE_SKEW_MS > stamp)
            return 0;
    }
    int with_delta = (w.seen & F_DELTA) != 0;
    if (with_delta && (w.all_time > MAX_ABS_DELTA || w.all_time < -MAX_ABS_DELTA || w.current > MAX_ABS_DELTA ||
                       w.current < -MAX_ABS_DELTA))
        return 0;
    if (kind->uses_delta && !with_delta)
        return 0;
    *wire = w;
    *kind_out = kind;
    return 1;
}

/* The event for one record, Py_None (borrowed) when it cannot be proven valid here, NULL on an error. */
static PyObject *decode_one(PyObject *key, PyObject *value, PyObject *timestamp) {
    Wire w;
    const Kind *kind;
    if (!check_one(key, value, timestamp, &w, &kind))
        return Py_None;
    PyObject *args[6] = {NULL, NULL, kind->name, NULL, NULL, NULL};
    Py_ssize_t nargs = kind->uses_delta ? 6 : 4;
    PyObject *event = NULL;
    args[0] = ascii_str(w.event_id, w.event_id_len);
    args[1] = ascii_str(w.skill_id, w.skill_id_len);
    args[3] = PyLong_FromLongLong(w.occurred_at);
    if (kind->uses_delta) {
        args[4] = PyLong_FromLongLong(w.all_time);
        args[5] = PyLong_FromLongLong(w.current);
    }
    if (args[0] && args[1] && args[3] && (!kind->uses_delta || (args[4] && args[5])))
        event = PyObject_Vectorcall(event_type, args, (size_t)nargs, NULL);
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    Py_XDECREF(args[3]);
    Py_XDECREF(args[4]);
    Py_XDECREF(args[5]);
    return event;
}

/* The three record columns as fast sequences (lists or tuples taken as they are) of one length, in `out` (new
   references, all NULL on failure); 0 on success. */
static int record_columns(PyObject *key_arg, PyObject *value_arg, PyObject *timestamp_arg, PyObject *out[3],
                          Py_ssize_t *n) {
    out[0] = PySequence_Fast(key_arg, "keys must be a sequence");
    out[1] = out[0] ? PySequence_Fast(value_arg, "values must be a sequence") : NULL;
    out[2] = out[1] ? PySequence_Fast(timestamp_arg, "timestamps must be a sequence") : NULL;
    if (out[2] != NULL) {
        *n = PySequence_Fast_GET_SIZE(out[1]);
        if (PySequence_Fast_GET_SIZE(out[0]) == *n && PySequence_Fast_GET_SIZE(out[2]) == *n)
            return 0;
        PyErr_SetString(PyExc_ValueError, "keys, values and timestamps must be of one length");
    }
    for (int j = 0; j < 3; j++)
        Py_CLEAR(out[j]);
    return -1;
}

/* pending.append(index); 0 on success. */
static int append_index(PyObject *pending, Py_ssize_t index) {
    PyObject *number = PyLong_FromSsize_t(index);
    int failed = number == NULL || PyList_Append(pending, number) < 0;
    Py_XDECREF(number);
    return failed ? -1 : 0;
}

PyDoc_STRVAR(decode_valid_doc,
             "decode_valid(keys, values, timestamps) -> (events, pending)\n\n"
             "The records this module can prove valid as StatEvents (None elsewhere in `events`), and the\n"
             "indexes of the others (`pending`), for the Python paths to decide. Three sequences of one length.");

static PyObject *decode_valid(PyObject *self, PyObject *args) {
    PyObject *key_arg, *value_arg, *timestamp_arg;
    if (!PyArg_ParseTuple(args, "OOO", &key_arg, &value_arg, &timestamp_arg))
        return NULL;
    if (event_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "skillstats._native is not configured");
        return NULL;
    }
    PyObject *events = NULL, *pending = NULL, *columns[3];
    Py_ssize_t n;
    if (record_columns(key_arg, value_arg, timestamp_arg, columns, &n) < 0)
        return NULL;
    PyObject *keys = columns[0], *values = columns[1], *timestamps = columns[2];
    events = PyList_New(n);
    pending = PyList_New(0);
    if (events == NULL || pending == NULL)
        goto fail;
    /* Items are borrowed: nothing in the loop runs Python code (StatEvent, a msgspec Struct without gc,
       is built in C, and no allocation here can start the cyclic collector), so the lists cannot change. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = decode_one(PySequence_Fast_GET_ITEM(keys, i), PySequence_Fast_GET_ITEM(values, i),
                                     PySequence_Fast_GET_ITEM(timestamps, i));
        if (event == NULL)
            goto fail;
        if (event == Py_None) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(events, i, Py_None);
            if (append_index(pending, i) < 0)
                goto fail;
        } else {
            PyList_SET_ITEM(events, i, event);
        }
    }
    Py_DECREF(keys);
    Py_DECREF(values);
    Py_DECREF(timestamps);
    return Py_BuildValue("(NN)", events, pending);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(timestamps);
    Py_XDECREF(events);
    Py_XDECREF(pending);
    return NULL;
}

/* ---- counts as Python ints (the docsync fold's) ----------------------------------------- */

static PyObject *str_kind, *str_skill_id, *str_occurred_at;

/* before + value as Python's int addition would: a long long sum when it fits, PyNumber_Add otherwise. */
static PyObject *add_int(PyObject *before, long long value) {
    int overflow = 0;
    long long b = PyLong_AsLongLongAndOverflow(before, &overflow);
    long long sum;
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (overflow == 0 && !__builtin_add_overflow(b, value, &sum))
        return PyLong_FromLongLong(sum);
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return NULL;
    PyObject *r = PyNumber_Add(before, v);
    Py_DECREF(v);
    return r;
}

/* counts[key] += values (a list of n ints), the list made when the key is new. 0 on success. */
static int add_counts(PyObject *counts, PyObject *key, const long long *values, Py_ssize_t n) {
    PyObject *row = PyDict_GetItemWithError(counts, key); /* borrowed */
    if (row == NULL) {
        if (PyErr_Occurred())
            return -1;
        row = PyList_New(n);
        if (row == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *count = PyLong_FromLongLong(values[i]);
            if (count == NULL) {
                Py_DECREF(row);
                return -1;
            }
            PyList_SET_ITEM(row, i, count);
        }
        int failed = PyDict_SetItem(counts, key, row);
        Py_DECREF(row);
        return failed;
    }
    if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != n) {
        PyErr_SetString(PyExc_TypeError, "a row to add to is not a list of the counters");
        return -1;
    }
    Py_INCREF(row); /* PyNumber_Add may run code that drops it from `counts` */
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(row); i++) {
        if (values[i] == 0)
            continue; /* the same count: no new int (most of a row's adds are zeros) */
        PyObject *before = PyList_GET_ITEM(row, i);
        Py_INCREF(before);
        PyObject *after = add_int(before, values[i]);
        Py_DECREF(before);
        if (after == NULL) {
            Py_DECREF(row);
            return -1;
        }
        PyList_SetItem(row, i, after); /* steals `after`, releases the old count */
    }
    Py_DECREF(row);
    return 0;
}

/* counts[key] += value, for a dict of plain ints. 0 on success. */
static int add_counts_scalar(PyObject *counts, PyObject *key, long long value) {
    PyObject *before = PyDict_GetItemWithError(counts, key); /* borrowed */
    PyObject *after;
    if (before == NULL) {
        if (PyErr_Occurred())
            return -1;
        after = PyLong_FromLongLong(value);
    } else {
        Py_INCREF(before);
        after = add_int(before, value);
        Py_DECREF(before);
    }
    if (after == NULL)
        return -1;
    int failed = PyDict_SetItem(counts, key, after);
    Py_DECREF(after);
    return failed;
}

/* ---- the windows rows ------------------------------------------------------------------- */

/* One (skill, hour) of a batch while it is folded: the counts as C ints, the skill held. */
typedef struct {
    PyObject *skill;        /* a reference held; NULL: an empty slot of the table */
    Py_hash_t hash;         /* the skill's str hash */
    unsigned long long head; /* a one-byte-wide skill's first 8 bytes, big-endian, zero-padded: the sort's
                                first comparison; 0 with `wide` set for a wider str */
    int wide;
    long long start; /* the hour's start, ms */
    long long downloads, installs;
} HourSlot;

/* Python's order of two str (code point by code point), without a call where both are one byte wide. */
static int compare_str(PyObject *a, PyObject *b) {
    if (a == b)
        return 0;
    if (PyUnicode_KIND(a) == PyUnicode_1BYTE_KIND && PyUnicode_KIND(b) == PyUnicode_1BYTE_KIND) {
        Py_ssize_t la = PyUnicode_GET_LENGTH(a), lb = PyUnicode_GET_LENGTH(b);
        int c = memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)(la < lb ? la : lb));
        return c != 0 ? c : (la > lb) - (la < lb);
    }
    return PyUnicode_Compare(a, b); /* cannot fail on two str */
}

static int compare_slots(const void *x, const void *y) {
    const HourSlot *a = x, *b = y;
    /* Two one-byte-wide str compare as their bytes do: the heads decide unless equal (a tie, or a shorter
       string's padding against a zero byte, goes on to the whole strings). */
    if (!a->wide && !b->wide && a->head != b->head)
        return a->head < b->head ? -1 : 1;
    int c = compare_str(a->skill, b->skill);
    return c != 0 ? c : (a->start > b->start) - (a->start < b->start);
}

/* floor(at / unit) * unit as Python's `at - at % unit`, for any sign; 0 on success. */
static int bucket_start(long long at, long long unit, long long *start) {
    long long rem = at % unit;
    if (rem < 0)
        rem += unit;
    if (__builtin_sub_overflow(at, rem, start)) {
        PyErr_SetString(PyExc_OverflowError, "occurred_at out of range");
        return -1;
    }
    return 0;
}

/* `convert(start)`, asked once per distinct start: `seen` maps the start's int to what it gave. New reference. */
static PyObject *converted(PyObject *seen, PyObject *convert, long long start) {
    PyObject *key = PyLong_FromLongLong(start);
    if (key == NULL)
        return NULL;
    PyObject *value = PyDict_GetItemWithError(seen, key); /* borrowed */
    if (value != NULL) {
        Py_DECREF(key);
        return Py_NewRef(value);
    }
    if (PyErr_Occurred() || (value = PyObject_CallOneArg(convert, key)) == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    int failed = PyDict_SetItem(seen, key, value);
    Py_DECREF(key);
    if (failed) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

/* Append (skill, convert(start), downloads, installs) to `rows`; 0 on success. */
static int append_row(PyObject *rows, PyObject *seen, PyObject *convert, PyObject *skill, long long start,
                      long long downloads, long long installs) {
    PyObject *at = converted(seen, convert, start);
    if (at == NULL)
        return -1;
    PyObject *row = PyTuple_New(4), *d = PyLong_FromLongLong(downloads), *i = PyLong_FromLongLong(installs);
    if (row == NULL || d == NULL || i == NULL) {
        Py_XDECREF(row);
        Py_XDECREF(d);
        Py_XDECREF(i);
        Py_DECREF(at);
        return -1;
    }
    PyTuple_SET_ITEM(row, 0, Py_NewRef(skill));
    PyTuple_SET_ITEM(row, 1, at);
    PyTuple_SET_ITEM(row, 2, d);
    PyTuple_SET_ITEM(row, 3, i);
    int failed = PyList_Append(rows, row);
    Py_DECREF(row);
    return failed;
}

/* A seeded hash of a skill id's code units (a str's data, or a record's bytes, which are its one-byte data):
   a table keyed by records' bytes cannot use the str hash without building the str. The seed is this process's
   str hash of a constant, so it changes with Python's own hash randomization and colliding ids cannot be
   prepared in advance any more than for a dict. */
static unsigned long long hash_seed = 0x243F6A8885A308D3ULL;

static inline unsigned long long mix(unsigned long long a, unsigned long long b) {
    __uint128_t r = (__uint128_t)a * b;
    return (unsigned long long)r ^ (unsigned long long)(r >> 64);
}

static unsigned long long skill_hash(const unsigned char *data, size_t size) {
    unsigned long long h = hash_seed ^ (size * 0x9E3779B97F4A7C15ULL);
    while (size >= 8) {
        unsigned long long word;
        memcpy(&word, data, 8);
        h = mix(h ^ word, 0xBF58476D1CE4E5B9ULL ^ hash_seed);
        data += 8;
        size -= 8;
    }
    unsigned long long tail = 0;
    memcpy(&tail, data, size);
    return mix(h ^ tail ^ 0x94D049BB133111EBULL, 0xA0761D6478BD642FULL ^ hash_seed);
}

/* A skill id as the table compares it: a str's data (its one-, two- or four-byte code units), or a record's
   ASCII bytes, which are the data of the one-byte str they decode to. Equal ids have equal data and width. */
typedef struct {
    const void *data;
    Py_ssize_t length; /* code units */
    int width;         /* bytes per code unit: PyUnicode_KIND */
    PyObject *str;     /* the str when there is one (borrowed), else NULL: made if the id is new */
} SkillKey;

/* A batch's windows counts while it is folded: a (skill, hour) table of C ints, records and events added to it
   in any order, its rows taken once. */
typedef struct {
    PyObject_HEAD
    HourSlot *slots;
    size_t capacity, used;
    PyObject *window;                  /* a copy of the kind -> (downloads, installs) table handed over */
    PyObject *names[MAX_KINDS];        /* the contract's kinds when made (the reader's table, checked on use) */
    int name_count;
    long long effects[MAX_KINDS][2];   /* names[k]'s window effect, when has_effect[k] */
    int has_effect[MAX_KINDS];
    long long taken[MAX_KINDS];        /* records add_records took, by kind */
    long long handed;                  /* records add_records was handed, taken or not */
    PyObject *kinds_added;             /* kind -> events add_events took (a dict) */
    int busy;                          /* a method is under way: an attribute read or a converter may call in */
    int done;                          /* 1: rows() ran, the slots are sorted, no longer a table; 2: an add
                                          failed part-way, what it added so far is in: fed again it would count
                                          twice */
} WindowFold;

static PyTypeObject WindowFoldType;

static int fold_grow(WindowFold *f) {
    size_t capacity = f->capacity * 2;
    HourSlot *slots = PyMem_Calloc(capacity, sizeof(HourSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < f->capacity; i++) {
        HourSlot *old = &f->slots[i];
        if (old->skill == NULL)
            continue;
        size_t at = (size_t)mix((unsigned long long)old->hash ^ (unsigned long long)old->start, 0x9E3779B97F4A7C15ULL) &
                    (capacity - 1);
        while (slots[at].skill != NULL)
            at = (at + 1) & (capacity - 1);
        slots[at] = *old;
    }
    PyMem_Free(f->slots);
    f->slots = slots;
    f->capacity = capacity;
    return 0;
}

/* Add (downloads, installs) to (skill, hour start)'s slot, made when new; 0 on success. */
static int fold_add(WindowFold *f, const SkillKey *key, long long start, long long downloads, long long installs) {
    if ((f->used + 1) * 2 > f->capacity && fold_grow(f) < 0)
        return -1;
    unsigned long long hash = skill_hash(key->data, (size_t)key->length * (size_t)key->width);
    size_t mask = f->capacity - 1;
    size_t at = (size_t)mix(hash ^ (unsigned long long)start, 0x9E3779B97F4A7C15ULL) & mask;
    HourSlot *slot;
    for (;;) {
        slot = &f->slots[at];
        if (slot->skill == NULL)
            break;
        if ((unsigned long long)slot->hash == hash && slot->start == start &&
            PyUnicode_KIND(slot->skill) == key->width && PyUnicode_GET_LENGTH(slot->skill) == key->length &&
            memcmp(PyUnicode_DATA(slot->skill), key->data, (size_t)key->length * (size_t)key->width) == 0)
            break;
        at = (at + 1) & mask;
    }
    if (slot->skill == NULL) {
        PyObject *skill = key->str != NULL ? Py_NewRef(key->str) : ascii_str(key->data, key->length);
        if (skill == NULL)
            return -1;
        slot->skill = skill;
        slot->hash = (Py_hash_t)hash;
        slot->start = start;
        slot->wide = key->width != 1;
        slot->head = 0;
        if (!slot->wide) {
            const unsigned char *bytes = key->data;
            for (Py_ssize_t b = 0; b < 8; b++)
                slot->head = (slot->head << 8) | (b < key->length ? bytes[b] : 0);
        }
        f->used++;
    }
    if (__builtin_add_overflow(slot->downloads, downloads, &slot->downloads) ||
        __builtin_add_overflow(slot->installs, installs, &slot->installs)) {
        PyErr_SetString(PyExc_OverflowError, "a window count past 64 bits in one batch");
        return -1;
    }
    return 0;
}

static int fold_enter(WindowFold *f) {
    if (f->busy || f->done) {
        PyErr_SetString(PyExc_RuntimeError,
                        f->busy       ? "this fold is in use (called back into from an attribute read or a converter)"
                        : f->done == 1 ? "this fold's rows were taken: nothing more can be added or taken"
                                       : "an add to this fold failed part-way: it holds part of that add, no rows");
        return -1;
    }
    f->busy = 1;
    return 0;
}

static PyObject *fold_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *window;
    static char *keywords[] = {"window_deltas", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!:WindowFold", keywords, &PyDict_Type, &window))
        return NULL;
    WindowFold *f = (WindowFold *)type->tp_alloc(type, 0);
    if (f == NULL)
        return NULL;
    f->capacity = 1024;
    f->slots = PyMem_Calloc(f->capacity, sizeof(HourSlot));
    f->window = PyDict_Copy(window);
    f->kinds_added = PyDict_New();
    if (f->slots == NULL || f->window == NULL || f->kinds_added == NULL) {
        if (f->slots == NULL)
            PyErr_NoMemory();
        Py_DECREF(f);
        return NULL;
    }
    /* Each kind's effect read once, as the per-event loop reads it from the table. */
    for (int k = 0; k < kind_count; k++) {
        f->names[k] = Py_NewRef(kinds[k].name);
        f->name_count = k + 1;
        PyObject *effect = PyDict_GetItemWithError(f->window, kinds[k].name); /* borrowed */
        if (effect == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(f);
                return NULL;
            }
            continue;
        }
        if (!PyTuple_Check(effect) || PyTuple_GET_SIZE(effect) != 2) {
            PyErr_SetString(PyExc_TypeError, "a window effect is not a tuple of two ints");
            Py_DECREF(f);
            return NULL;
        }
        for (Py_ssize_t j = 0; j < 2; j++) {
            f->effects[k][j] = PyLong_AsLongLong(PyTuple_GET_ITEM(effect, j));
            if (f->effects[k][j] == -1 && PyErr_Occurred()) {
                Py_DECREF(f);
                return NULL;
            }
        }
        f->has_effect[k] = 1;
    }
    return (PyObject *)f;
}

static void fold_dealloc(WindowFold *f) {
    if (f->slots != NULL) {
        for (size_t i = 0; i < f->capacity; i++)
            Py_XDECREF(f->slots[i].skill);
        PyMem_Free(f->slots);
    }
    for (int k = 0; k < f->name_count; k++)
        Py_XDECREF(f->names[k]);
    Py_XDECREF(f->window);
    Py_XDECREF(f->kinds_added);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

/* Each event's window effect added (its kind counted in kinds_added when `count_kinds`); 0 on success. */
static int fold_events(WindowFold *f, PyObject *events, int count_kinds) {
    PyObject *seq = PySequence_Tuple(events); /* a snapshot: the loop runs code that may change a list */
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = PyTuple_GET_ITEM(seq, i);
        PyObject *kind = PyObject_GetAttr(event, str_kind);
        if (kind == NULL)
            goto fail;
        if (count_kinds && add_counts_scalar(f->kinds_added, kind, 1) < 0) {
            Py_DECREF(kind);
            goto fail;
        }
        PyObject *effect = PyDict_GetItemWithError(f->window, kind); /* borrowed, kept alive by the copy */
        Py_DECREF(kind);
        if (effect == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue; /* a kind that counts nothing in the windows */
        }
        if (!PyTuple_Check(effect) || PyTuple_GET_SIZE(effect) != 2) {
            PyErr_SetString(PyExc_TypeError, "a window effect is not a tuple of two ints");
            goto fail;
        }
        long long downloads = PyLong_AsLongLong(PyTuple_GET_ITEM(effect, 0));
        long long installs = PyLong_AsLongLong(PyTuple_GET_ITEM(effect, 1));
        if (PyErr_Occurred())
            goto fail;
        PyObject *at_obj = PyObject_GetAttr(event, str_occurred_at);
        if (at_obj == NULL)
            goto fail;
        long long at = PyLong_AsLongLong(at_obj);
        Py_DECREF(at_obj);
        long long start;
        if ((at == -1 && PyErr_Occurred()) || bucket_start(at, MS_PER_HOUR, &start))
            goto fail;
        PyObject *skill = PyObject_GetAttr(event, str_skill_id);
        if (skill == NULL)
            goto fail;
        if (!PyUnicode_Check(skill)) {
            Py_DECREF(skill);
            PyErr_SetString(PyExc_TypeError, "an event's skill_id is not a str");
            goto fail;
        }
        SkillKey key = {PyUnicode_DATA(skill), PyUnicode_GET_LENGTH(skill), PyUnicode_KIND(skill), skill};
        int failed = fold_add(f, &key, start, downloads, installs);
        Py_DECREF(skill);
        if (failed)
            goto fail;
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

/* The rows of the slots in use: moved to the front and sorted, so the hours come in (skill, hour) order and each
   (skill, day)'s hours next to each other, the days summed in the same pass. Leaves the slots unusable as a
   table. A new (hourly, daily) tuple, NULL on an error. */
static PyObject *fold_rows_of(WindowFold *f, PyObject *hour_of, PyObject *day_of) {
    HourSlot *slots = f->slots;
    PyObject *hourly = PyList_New(0), *daily = PyList_New(0), *hours_seen = PyDict_New(), *days_seen = PyDict_New();
    PyObject *result = NULL;
    if (hourly == NULL || daily == NULL || hours_seen == NULL || days_seen == NULL)
        goto done;
    size_t rows = 0;
    for (size_t i = 0; i < f->capacity; i++)
        if (slots[i].skill != NULL) {
            if (i != rows) {
                slots[rows] = slots[i];
                slots[i].skill = NULL;
            }
            rows++;
        }
    qsort(slots, rows, sizeof(HourSlot), compare_slots);
    PyObject *day_skill = NULL;
    long long day = 0, day_downloads = 0, day_installs = 0;
    for (size_t i = 0; i < rows; i++) {
        HourSlot *slot = &slots[i];
        long long start;
        if (bucket_start(slot->start, MS_PER_DAY, &start))
            goto done;
        if (append_row(hourly, hours_seen, hour_of, slot->skill, slot->start, slot->downloads, slot->installs))
            goto done;
        if (day_skill != NULL && start == day && compare_str(day_skill, slot->skill) == 0) {
            if (__builtin_add_overflow(day_downloads, slot->downloads, &day_downloads) ||
                __builtin_add_overflow(day_installs, slot->installs, &day_installs)) {
                PyErr_SetString(PyExc_OverflowError, "a window count past 64 bits in one batch");
                goto done;
            }
            continue;
        }
        if (day_skill != NULL && append_row(daily, days_seen, day_of, day_skill, day, day_downloads, day_installs))
            goto done;
        day_skill = slot->skill; /* held by its slot until the fold is freed */
        day = start;
        day_downloads = slot->downloads;
        day_installs = slot->installs;
    }
    if (day_skill != NULL && append_row(daily, days_seen, day_of, day_skill, day, day_downloads, day_installs))
        goto done;
    result = PyTuple_Pack(2, hourly, daily);
done:
    Py_XDECREF(hourly);
    Py_XDECREF(daily);
    Py_XDECREF(hours_seen);
    Py_XDECREF(days_seen);
    return result;
}

PyDoc_STRVAR(fold_add_records_doc,
             "add_records(keys, values, timestamps) -> (pending, newest)\n\n"
             "decode_valid and add_events in one pass, with no event built: each record decode_valid would take is\n"
             "counted by kind and its window effect added; `pending` the indexes of the others, for the Python paths\n"
             "to decide (their valid events go to add_events); `newest` the latest occurred_at of the records taken,\n"
             "None when none was. Three sequences of one length.");

static PyObject *fold_add_records(WindowFold *f, PyObject *args) {
    PyObject *key_arg, *value_arg, *timestamp_arg;
    if (!PyArg_ParseTuple(args, "OOO", &key_arg, &value_arg, &timestamp_arg))
        return NULL;
    if (event_type == NULL || kind_count != f->name_count) {
        PyErr_SetString(PyExc_RuntimeError, "skillstats._native was configured again after this fold was made");
        return NULL;
    }
    for (int k = 0; k < kind_count; k++)
        if (kinds[k].name != f->names[k]) {
            PyErr_SetString(PyExc_RuntimeError, "skillstats._native was configured again after this fold was made");
            return NULL;
        }
    if (fold_enter(f) < 0)
        return NULL;
    PyObject *pending = NULL, *result = NULL;
    long long newest = -1;
    int started = 0; /* the records are being added: a failure from here leaves part of them in */
    PyObject *columns[3] = {NULL, NULL, NULL};
    Py_ssize_t n = 0;
    if (record_columns(key_arg, value_arg, timestamp_arg, columns, &n) < 0)
        goto done;
    PyObject *keys = columns[0], *values = columns[1], *timestamps = columns[2];
    pending = PyList_New(0);
    if (pending == NULL)
        goto done;
    started = 1;
    /* Items are borrowed: nothing in the loop runs Python code (only str and int are made, which cannot start
       the cyclic collector), so the sequences cannot change under it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        Wire w;
        const Kind *kind;
        if (!check_one(PySequence_Fast_GET_ITEM(keys, i), PySequence_Fast_GET_ITEM(values, i),
                       PySequence_Fast_GET_ITEM(timestamps, i), &w, &kind)) {
            if (append_index(pending, i) < 0)
                goto done;
            continue;
        }
        int k = (int)(kind - kinds);
        f->taken[k]++;
        if (w.occurred_at > newest)
            newest = w.occurred_at;
        if (!f->has_effect[k])
            continue;
        long long start;
        if (bucket_start(w.occurred_at, MS_PER_HOUR, &start))
            goto done;
        SkillKey key = {w.skill_id, w.skill_id_len, PyUnicode_1BYTE_KIND, NULL};
        if (fold_add(f, &key, start, f->effects[k][0], f->effects[k][1]) < 0)
            goto done;
    }
    f->handed += n;
    if (newest < 0)
        result = Py_BuildValue("(OO)", pending, Py_None);
    else
        result = Py_BuildValue("(OL)", pending, newest);
done:
    f->busy = 0;
    if (result == NULL && started)
        f->done = 2;
    for (int j = 0; j < 3; j++)
        Py_XDECREF(columns[j]);
    Py_XDECREF(pending);
    return result;
}

PyDoc_STRVAR(fold_add_events_doc,
             "add_events(events)\n\n"
             "Each event's kind counted and its window effect added, as window_rows folds it (None is not an event).");

static PyObject *fold_add_events(WindowFold *f, PyObject *events) {
    if (fold_enter(f) < 0)
        return NULL;
    int failed = fold_events(f, events, 1);
    f->busy = 0;
    if (failed) {
        f->done = 2;
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(fold_kinds_doc, "kinds() -> {kind: count}: the valid records and events added, by kind.");

static PyObject *fold_kinds(WindowFold *f, PyObject *unused) {
    if (f->done == 2) {
        PyErr_SetString(PyExc_RuntimeError, "an add to this fold failed part-way: it holds part of that add, no kinds");
        return NULL;
    }
    PyObject *counts = PyDict_Copy(f->kinds_added);
    if (counts == NULL)
        return NULL;
    for (int k = 0; k < f->name_count; k++)
        if (f->taken[k] && add_counts_scalar(counts, f->names[k], f->taken[k]) < 0) {
            Py_DECREF(counts);
            return NULL;
        }
    return counts;
}

PyDoc_STRVAR(fold_handed_doc, "handed() -> int: the records add_records was handed, taken or left pending.");

static PyObject *fold_handed(WindowFold *f, PyObject *unused) { return PyLong_FromLongLong(f->handed); }

PyDoc_STRVAR(fold_rows_doc,
             "rows(hour_of, day_of) -> (hourly_rows, daily_rows)\n\n"
             "window_rows' rows of everything added, once: the fold takes nothing more after it.");

static PyObject *fold_rows_method(WindowFold *f, PyObject *args) {
    PyObject *hour_of, *day_of;
    if (!PyArg_ParseTuple(args, "OO", &hour_of, &day_of))
        return NULL;
    if (fold_enter(f) < 0)
        return NULL;
    f->done = 1; /* the slots are sorted in place from here on, even if a converter fails */
    PyObject *rows = fold_rows_of(f, hour_of, day_of);
    f->busy = 0;
    return rows;
}

static PyMethodDef fold_methods[] = {
    {"add_records", (PyCFunction)fold_add_records, METH_VARARGS, fold_add_records_doc},
    {"add_events", (PyCFunction)fold_add_events, METH_O, fold_add_events_doc},
    {"kinds", (PyCFunction)fold_kinds, METH_NOARGS, fold_kinds_doc},
    {"handed", (PyCFunction)fold_handed, METH_NOARGS, fold_handed_doc},
    {"rows", (PyCFunction)fold_rows_method, METH_VARARGS, fold_rows_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(window_fold_doc,
             "WindowFold(window_deltas)\n\n"
             "sinks.windows.fold_rows over a batch given piece by piece: records (add_records, no event built) and\n"
             "events (add_events) added in any order, the kinds counted, the rows taken once (rows).");

static PyTypeObject WindowFoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "skillstats._native.WindowFold",
    .tp_basicsize = sizeof(WindowFold),
    .tp_dealloc = (destructor)fold_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = window_fold_doc,
    .tp_methods = fold_methods,
    .tp_new = fold_new,
};

PyDoc_STRVAR(window_rows_doc,
             "window_rows(events, window_deltas, hour_of, day_of) -> (hourly_rows, daily_rows)\n\n"
             "sinks.windows.fold_rows: (skill_id, hour_of(hour start ms), downloads, installs) per (skill, UTC hour)\n"
             "of the events' window effects, in (skill_id, hour) order, and the same per UTC day with day_of;\n"
             "hour_of and day_of are called once per distinct start.");

static PyObject *window_rows(PyObject *self, PyObject *args) {
    PyObject *events, *window, *hour_of, *day_of;
    if (!PyArg_ParseTuple(args, "OO!OO", &events, &PyDict_Type, &window, &hour_of, &day_of))
        return NULL;
    WindowFold *f = (WindowFold *)PyObject_CallOneArg((PyObject *)&WindowFoldType, window);
    if (f == NULL)
        return NULL;
    PyObject *rows = NULL;
    f->busy = 1; /* not reachable from Python: the flag only keeps the type's own rules */
    if (fold_events(f, events, 0) == 0) {
        f->done = 1;
        rows = fold_rows_of(f, hour_of, day_of);
    }
    Py_DECREF(f);
    return rows;
}

/* ---- the docsync fold ------------------------------------------------------------------- */

static PyObject *str_delta_all_time, *str_delta_current;

static PyObject *get_int(PyObject *event, PyObject *name, long long *out) {
    PyObject *value = PyObject_GetAttr(event, name);
    if (value == NULL)
        return NULL;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? NULL : Py_None;
}

PyDoc_STRVAR(fold_skills_doc,
             "fold_skills(events, fixed_skill_deltas, kinds, deltas)\n\n"
             "sinks.docstats.PartitionDeltas.add_decoded's loop: for each event (None skipped) kinds[kind] += 1 and\n"
             "deltas[skill_id] += [downloads, installs_all_time, installs_current, 1], in place.");

static PyObject *fold_skills(PyObject *self, PyObject *args) {
    PyObject *events, *fixed, *kinds_seen, *deltas;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &events, &PyDict_Type, &fixed, &PyDict_Type, &kinds_seen, &PyDict_Type,
                          &deltas))
        return NULL;
    PyObject *seq = PySequence_Tuple(events); /* a snapshot: the loop runs code that may change a list */
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *event = items[i];
        if (event == Py_None)
            continue;
        PyObject *kind = PyObject_GetAttr(event, str_kind);
        if (kind == NULL)
            goto fail;
        long long values[4] = {0, 0, 0, 1};
        PyObject *effect = PyDict_GetItemWithError(fixed, kind); /* borrowed */
        int failed = effect == NULL && PyErr_Occurred();
        if (!failed)
            failed = add_counts_scalar(kinds_seen, kind, 1);
        Py_DECREF(kind);
        if (failed)
            goto fail;
        if (effect != NULL) {
            for (Py_ssize_t j = 0; j < 3; j++) {
                values[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(effect, j));
                if (values[j] == -1 && PyErr_Occurred())
                    goto fail;
            }
        } else if (get_int(event, str_delta_all_time, &values[1]) == NULL ||
                   get_int(event, str_delta_current, &values[2]) == NULL) {
            goto fail;
        }
        PyObject *skill_id = PyObject_GetAttr(event, str_skill_id);
        if (skill_id == NULL)
            goto fail;
        failed = add_counts(deltas, skill_id, values, 4);
        Py_DECREF(skill_id);
        if (failed)
            goto fail;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(fold_records_doc,
             "fold_records(keys, values, timestamps, fixed_skill_deltas, kinds, deltas) -> pending\n\n"
             "decode_valid and fold_skills in one pass, with no event built: each record decode_valid would take is\n"
             "counted into kinds and deltas as fold_skills counts its event; the indexes of the others are returned,\n"
             "for the Python paths to decide and fold. Three sequences of one length, then three dicts.");

static PyObject *fold_records(PyObject *self, PyObject *args) {
    PyObject *key_arg, *value_arg, *timestamp_arg, *fixed, *kinds_seen, *deltas;
    if (!PyArg_ParseTuple(args, "OOOO!O!O!", &key_arg, &value_arg, &timestamp_arg, &PyDict_Type, &fixed,
                          &PyDict_Type, &kinds_seen, &PyDict_Type, &deltas))
        return NULL;
    if (event_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "skillstats._native is not configured");
        return NULL;
    }
    /* Tuples, not the callers' lists: a new skill's row is a list, whose allocation may start the cyclic
       collector, whose finalizers may run any code. */
    PyObject *pending = NULL;
    PyObject *keys = PySequence_Tuple(key_arg);
    PyObject *values = keys ? PySequence_Tuple(value_arg) : NULL;
    PyObject *timestamps = values ? PySequence_Tuple(timestamp_arg) : NULL;
    if (timestamps == NULL)
        goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    if (PyTuple_GET_SIZE(keys) != n || PyTuple_GET_SIZE(timestamps) != n) {
        PyErr_SetString(PyExc_ValueError, "keys, values and timestamps must be of one length");
        goto fail;
    }
    /* Each kind's effect read once per call, as fold_skills reads it per event: the fixed table's entry,
       else the event's own delta (none on the wire for a kind that takes none: a StatEvent's zeros). */
    long long effects[MAX_KINDS][3];
    int has_effect[MAX_KINDS];
    Py_ssize_t counted[MAX_KINDS] = {0};
    for (int k = 0; k < kind_count; k++) {
        PyObject *effect = PyDict_GetItemWithError(fixed, kinds[k].name); /* borrowed */
        has_effect[k] = effect != NULL;
        if (effect == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (!PyTuple_CheckExact(effect) || PyTuple_GET_SIZE(effect) != 3) {
            PyErr_SetString(PyExc_TypeError, "a fixed effect is not a tuple of three ints");
            goto fail;
        }
        for (Py_ssize_t j = 0; j < 3; j++) {
            effects[k][j] = PyLong_AsLongLong(PyTuple_GET_ITEM(effect, j));
            if (effects[k][j] == -1 && PyErr_Occurred())
                goto fail;
        }
    }
    pending = PyList_New(0);
    if (pending == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Wire w;
        const Kind *kind;
        if (!check_one(PyTuple_GET_ITEM(keys, i), PyTuple_GET_ITEM(values, i), PyTuple_GET_ITEM(timestamps, i),
                       &w, &kind)) {
            if (append_index(pending, i) < 0)
                goto fail;
            continue;
        }
        int k = (int)(kind - kinds);
        long long row[4] = {0, 0, 0, 1};
        if (has_effect[k]) {
            row[0] = effects[k][0];
            row[1] = effects[k][1];
            row[2] = effects[k][2];
        } else if (kind->uses_delta) {
            row[1] = w.all_time;
            row[2] = w.current;
        }
        counted[k]++;
        PyObject *skill_id = ascii_str(w.skill_id, w.skill_id_len);
        if (skill_id == NULL)
            goto fail;
        int failed = add_counts(deltas, skill_id, row, 4);
        Py_DECREF(skill_id);
        if (failed)
            goto fail;
    }
    for (int k = 0; k < kind_count; k++)
        if (counted[k] && add_counts_scalar(kinds_seen, kinds[k].name, counted[k]) < 0)
            goto fail;
    Py_DECREF(keys);
    Py_DECREF(values);
    Py_DECREF(timestamps);
    return pending;
fail:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(timestamps);
    Py_XDECREF(pending);
    return NULL;
}

/* ---- docsync's messages ----------------------------------------------------------------- */

static PyObject *str_error, *str_partition, *str_offset, *str_timestamp, *str_key, *str_value, *str_events,
    *str_next_offset, *str_events_read;

/* The partition a run of messages is in, and what take_run knows of it while the run lasts. */
typedef struct {
    long long partition;
    int active;             /* a partition is loaded */
    int skipped;            /* not read here: not assigned to this drain, or finished */
    PyObject *part;         /* its PartitionDeltas (strong), or NULL */
    PyObject *columns[3];   /* keys, values, timestamps: the lists in taken[partition] (strong) */
    long long end;          /* ends.get(partition, 0) */
    long long next_offset;  /* part.next_offset, kept here while the run lasts */
    long long added;        /* messages appended since it was loaded */
} TakeRun;

/* part.events += added; part.next_offset = next_offset; summary.events_read += added; then forget the partition.
   Keeps an error set on entry: what was appended before it is counted, as take() counts each message. */
static int take_flush(TakeRun *run, PyObject *summary) {
    int failed = 0;
    if (run->active && run->part != NULL && run->added > 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *events = PyObject_GetAttr(run->part, str_events);
        PyObject *sum = events == NULL ? NULL : add_int(events, run->added);
        PyObject *next = sum == NULL ? NULL : PyLong_FromLongLong(run->next_offset);
        PyObject *read = next == NULL ? NULL : PyObject_GetAttr(summary, str_events_read);
        PyObject *read_sum = read == NULL ? NULL : add_int(read, run->added);
        failed = read_sum == NULL || PyObject_SetAttr(run->part, str_events, sum) < 0 ||
                 PyObject_SetAttr(run->part, str_next_offset, next) < 0 ||
                 PyObject_SetAttr(summary, str_events_read, read_sum) < 0;
        Py_XDECREF(events);
        Py_XDECREF(sum);
        Py_XDECREF(next);
        Py_XDECREF(read);
        Py_XDECREF(read_sum);
        if (type != NULL) {
            if (failed)
                PyErr_Clear(); /* the first error is the one to report */
            PyErr_Restore(type, value, traceback);
        }
    }
    Py_CLEAR(run->part);
    for (int j = 0; j < 3; j++)
        Py_CLEAR(run->columns[j]);
    run->active = 0;
    return failed ? -1 : 0;
}

static int take_load(TakeRun *run, PyObject *partition, long long number, PyObject *parts, PyObject *finished,
                     PyObject *ends) {
    run->active = 1;
    run->partition = number;
    run->added = 0;
    run->skipped = 1;
    PyObject *part = PyDict_GetItemWithError(parts, partition); /* borrowed */
    if (part == NULL)
        return PyErr_Occurred() ? -1 : 0;
    int done = PySet_Contains(finished, partition);
    if (done != 0)
        return done < 0 ? -1 : 0;
    PyObject *end = PyDict_GetItemWithError(ends, partition); /* borrowed */
    if (end == NULL && PyErr_Occurred())
        return -1;
    run->end = end == NULL ? 0 : PyLong_AsLongLong(end);
    if (run->end == -1 && PyErr_Occurred())
        return -1;
    PyObject *next = PyObject_GetAttr(part, str_next_offset);
    if (next == NULL)
        return -1;
    run->next_offset = PyLong_AsLongLong(next);
    Py_DECREF(next);
    if (run->next_offset == -1 && PyErr_Occurred())
        return -1;
    Py_INCREF(part);
    run->part = part;
    run->skipped = 0;
    return 0;
}

/* taken.setdefault(partition, (part, [], [], [])), its lists kept in `run`: on the first message appended, as
   take() does, so that a partition with nothing taken has no entry. */
static int take_columns(TakeRun *run, PyObject *taken) {
    PyObject *partition = PyLong_FromLongLong(run->partition);
    PyObject *fresh = partition == NULL ? NULL : Py_BuildValue("(O[][][])", run->part);
    PyObject *columns = fresh == NULL ? NULL : PyDict_SetDefault(taken, partition, fresh); /* borrowed */
    Py_XDECREF(partition);
    Py_XDECREF(fresh);
    if (columns == NULL)
        return -1;
    if (!PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) != 4 || PyTuple_GET_ITEM(columns, 0) != run->part) {
        PyErr_SetString(PyExc_TypeError, "taken[partition] must be (its PartitionDeltas, keys, values, timestamps)");
        return -1;
    }
    for (int j = 0; j < 3; j++)
        if (!PyList_Check(PyTuple_GET_ITEM(columns, j + 1))) {
            PyErr_SetString(PyExc_TypeError, "taken[partition]'s columns must be lists");
            return -1;
        }
    for (int j = 0; j < 3; j++) {
        PyObject *list = PyTuple_GET_ITEM(columns, j + 1);
        Py_INCREF(list);
        run->columns[j] = list;
    }
    return 0;
}

/* method() of `message` as a C long long; -1 with an error set on failure. */
static int call_long(PyObject *message, PyObject *method, long long *out) {
    PyObject *value = PyObject_CallMethodNoArgs(message, method);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

PyDoc_STRVAR(take_run_doc,
             "take_run(messages, start, parts, finished, ends, taken, summary, timestamp_not_available) -> stop\n\n"
             "streams.docsync's take() over messages[start:], for as long as each message is an ordinary one:\n"
             "without an error, and (in a partition this drain reads and has not finished) below the snapshot\n"
             "end's last offset. Messages of partitions not in `parts`, or in `finished`, and copies below a\n"
             "partition's next_offset are passed over; the others' key, value and timestamp are appended to\n"
             "taken[partition] (created as (part, [], [], []) when missing), the part's events and next_offset\n"
             "moved and summary.events_read counted. Returns the index of the first message it left to take()\n"
             "(len(messages) when none). Nothing here finishes or pauses a partition: the message that would is left.");

static PyObject *take_run(PyObject *self, PyObject *args) {
    PyObject *messages, *parts, *finished, *ends, *taken, *summary;
    Py_ssize_t start;
    long long not_available;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!O!OL", &PyList_Type, &messages, &start, &PyDict_Type, &parts, &PySet_Type,
                          &finished, &PyDict_Type, &ends, &PyDict_Type, &taken, &summary, &not_available))
        return NULL;
    TakeRun run = {0};
    PyObject *message = NULL;
    Py_ssize_t i = start < 0 ? 0 : start < PyList_GET_SIZE(messages) ? start : PyList_GET_SIZE(messages);
    for (; i < PyList_GET_SIZE(messages); i++) {
        message = PyList_GET_ITEM(messages, i);
        Py_INCREF(message); /* the methods below run code that could change the list */
        PyObject *error = PyObject_CallMethodNoArgs(message, str_error);
        if (error == NULL)
            goto fail;
        int ordinary = error == Py_None;
        Py_DECREF(error);
        if (!ordinary)
            break;
        PyObject *partition = PyObject_CallMethodNoArgs(message, str_partition);
        if (partition == NULL)
            goto fail;
        if (!PyLong_CheckExact(partition)) { /* not a partition number (librdkafka's UA is None): take()'s */
            Py_DECREF(partition);
            break;
        }
        long long number = PyLong_AsLongLong(partition);
        int failed = number == -1 && PyErr_Occurred();
        if (!failed && (!run.active || run.partition != number))
            failed = take_flush(&run, summary) < 0 || take_load(&run, partition, number, parts, finished, ends) < 0;
        Py_DECREF(partition);
        if (failed)
            goto fail;
        if (run.skipped) {
            Py_CLEAR(message);
            continue;
        }
        long long offset;
        if (call_long(message, str_offset, &offset) < 0)
            goto fail;
        if (offset >= run.end - 1) /* the snapshot's last offset or past it: take() finishes the partition */
            break;
        if (offset < run.next_offset) { /* handed over twice: the first copy counted */
            Py_CLEAR(message);
            continue;
        }
        PyObject *stamp = PyObject_CallMethodNoArgs(message, str_timestamp);
        if (stamp == NULL)
            goto fail;
        PyObject *stamp_value = NULL;
        if (!PyTuple_Check(stamp) || PyTuple_GET_SIZE(stamp) != 2) {
            PyErr_SetString(PyExc_TypeError, "a message's timestamp() must be (type, value)");
        } else {
            long long type = PyLong_AsLongLong(PyTuple_GET_ITEM(stamp, 0));
            if (!(type == -1 && PyErr_Occurred()))
                stamp_value = type == not_available ? Py_None : PyTuple_GET_ITEM(stamp, 1);
        }
        Py_XINCREF(stamp_value);
        Py_DECREF(stamp);
        if (stamp_value == NULL)
            goto fail;
        PyObject *key = PyObject_CallMethodNoArgs(message, str_key);
        PyObject *value = key == NULL ? NULL : PyObject_CallMethodNoArgs(message, str_value);
        failed = value == NULL || (run.columns[0] == NULL && take_columns(&run, taken) < 0);
        if (!failed) {
            Py_ssize_t lengths[3];
            for (int j = 0; j < 3; j++)
                lengths[j] = PyList_GET_SIZE(run.columns[j]);
            failed = PyList_Append(run.columns[0], key) < 0 || PyList_Append(run.columns[1], value) < 0 ||
                     PyList_Append(run.columns[2], stamp_value) < 0;
            if (failed) /* the columns stay of one length: what this message appended goes */
                for (int j = 0; j < 3; j++)
                    if (PyList_GET_SIZE(run.columns[j]) > lengths[j])
                        PyList_SetSlice(run.columns[j], lengths[j], PyList_GET_SIZE(run.columns[j]), NULL);
        }
        Py_XDECREF(key);
        Py_XDECREF(value);
        Py_DECREF(stamp_value);
        if (failed)
            goto fail;
        run.next_offset = offset + 1;
        run.added++;
        Py_CLEAR(message);
    }
    Py_XDECREF(message);
    if (take_flush(&run, summary) < 0)
        return NULL;
    return PyLong_FromSsize_t(i);
fail:
    Py_XDECREF(message);
    take_flush(&run, summary); /* what was appended before the error is counted, as take() counts it */
    return NULL;
}

/* ---- the windows worker's fetch path ---------------------------------------------------------- */

/* A v2 record batch's records (Kafka's DefaultRecord, after the batch's header and any decompression) read
   straight into the columns the windows drain reads (streams/aiokafka_records.py): no record object per record,
   where aiokafka's reader built one and the drain then read five attributes of each. It reads what aiokafka's
   DefaultRecordBatch reads, in the same order, and refuses what it refuses. */

/* Kafka's zig-zag varint of at most ten bytes (aiokafka's decode_varint). 0 at the end of the data or past ten. */
static inline int read_varint(const unsigned char **at, const unsigned char *end, long long *out) {
    unsigned long long value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*at >= end)
            return 0;
        unsigned char byte = *(*at)++;
        value |= (unsigned long long)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = (long long)(value >> 1) ^ -(long long)(value & 1);
            return 1;
        }
    }
    return 0;
}

/* A length-prefixed field: its bytes, or NULL (length -1, or any negative: aiokafka reads them all as None). 0 if
   it runs past the data. */
static inline int read_field(const unsigned char **at, const unsigned char *end, const unsigned char **start,
                             long long *length) {
    if (!read_varint(at, end, length))
        return 0;
    if (*length < 0) {
        *start = NULL;
        return 1;
    }
    if (*length > end - *at)
        return 0;
    *start = *at;
    *at += *length;
    return 1;
}

static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL)
        return -1;
    int failed = PyList_Append(list, item);
    Py_DECREF(item);
    return failed;
}

static PyObject *field_bytes(const unsigned char *start, long long length) {
    if (start == NULL)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)start, (Py_ssize_t)length);
}

PyDoc_STRVAR(batch_columns_doc,
             "batch_columns(records, count, base_offset, first_timestamp, append_time, position, columns) -> int\n\n"
             "Read `count` records of a v2 record batch (`records`: the bytes after its header, decompressed) and\n"
             "append each one at or past the position as it stands at it (`position`, then one past the last kept)\n"
             "to `columns`: five lists (offsets, timestamps, keys, values, headers; a record without headers gets\n"
             "an empty tuple, one with headers a list of (str, bytes or None)). A record's timestamp is\n"
             "`append_time` when that is not None (the batch's max timestamp, LOG_APPEND_TIME), else\n"
             "`first_timestamp` plus its delta. Returns the position after. ValueError for data aiokafka would not\n"
             "read: a field past the end, a record whose length does not match, bytes left after the last record.");

static PyObject *batch_columns(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t count;
    long long base_offset, first_timestamp, position;
    PyObject *append_time, *offsets, *stamps, *keys, *values, *headers;
    if (!PyArg_ParseTuple(args, "y*nLLOL(O!O!O!O!O!)", &data, &count, &base_offset, &first_timestamp, &append_time,
                          &position, &PyList_Type, &offsets, &PyList_Type, &stamps, &PyList_Type, &keys,
                          &PyList_Type, &values, &PyList_Type, &headers))
        return NULL;
    long long fixed_stamp = 0;
    int fixed = append_time != Py_None;
    if (fixed && (fixed_stamp = PyLong_AsLongLong(append_time)) == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const unsigned char *at = data.buf, *end = at + data.len;
    const char *corrupt = NULL;
    for (Py_ssize_t i = 0; i < count && corrupt == NULL; i++) {
        long long length, attributes, stamp_delta, offset_delta, key_length, value_length, header_count;
        const unsigned char *key, *value;
        if (!read_varint(&at, end, &length)) {
            corrupt = "a record's length runs past the batch";
            break;
        }
        const unsigned char *start = at;
        if (!read_varint(&at, end, &attributes) || !read_varint(&at, end, &stamp_delta) ||
            !read_varint(&at, end, &offset_delta) || !read_field(&at, end, &key, &key_length) ||
            !read_field(&at, end, &value, &value_length) || !read_varint(&at, end, &header_count)) {
            corrupt = "a record runs past the batch";
            break;
        }
        if (header_count < 0) {
            corrupt = "a record has a negative number of headers";
            break;
        }
        long long offset, stamp = 0;
        if (__builtin_add_overflow(base_offset, offset_delta, &offset) ||
            (!fixed && __builtin_add_overflow(first_timestamp, stamp_delta, &stamp))) {
            corrupt = "a record's offset or timestamp is past 64 bits";
            break;
        }
        int keep = offset >= position;
        /* Every header is read (its key decoded) whether the record is kept or not, as aiokafka reads them. */
        PyObject *record_headers = header_count == 0 ? (keep ? PyTuple_New(0) : Py_NewRef(Py_None)) : PyList_New(0);
        if (record_headers == NULL)
            goto failed;
        for (long long h = 0; h < header_count; h++) {
            const unsigned char *name, *content;
            long long name_length, content_length;
            if (!read_field(&at, end, &name, &name_length) || !read_field(&at, end, &content, &content_length)) {
                corrupt = "a record's header runs past the batch";
                break;
            }
            if (name == NULL) {
                corrupt = "a record's header has a negative key size";
                break;
            }
            PyObject *text = PyUnicode_DecodeUTF8((const char *)name, (Py_ssize_t)name_length, NULL);
            PyObject *raw = text == NULL ? NULL : field_bytes(content, content_length);
            PyObject *pair = raw == NULL ? NULL : PyTuple_Pack(2, text, raw);
            Py_XDECREF(text);
            Py_XDECREF(raw);
            if (append_new(record_headers, pair) < 0) {
                Py_DECREF(record_headers);
                goto failed;
            }
        }
        if (corrupt == NULL && at - start != length)
            corrupt = "a record's length does not match its fields";
        if (corrupt != NULL || !keep) {
            Py_DECREF(record_headers);
            continue;
        }
        if (offset == LLONG_MAX) { /* one past it is no int64 (nor any offset Kafka hands out) */
            Py_DECREF(record_headers);
            corrupt = "a record's offset is past 64 bits";
            break;
        }
        /* The headers first: the lists stay of one length whichever append fails (the caller drops them). */
        if (append_new(headers, record_headers) < 0 || append_new(offsets, PyLong_FromLongLong(offset)) < 0 ||
            append_new(stamps, PyLong_FromLongLong(fixed ? fixed_stamp : stamp)) < 0 ||
            append_new(keys, field_bytes(key, key_length)) < 0 ||
            append_new(values, field_bytes(value, value_length)) < 0)
            goto failed;
        position = offset + 1;
    }
    if (corrupt == NULL && at != end)
        corrupt = "bytes are left after the batch's last record";
    PyBuffer_Release(&data);
    if (corrupt != NULL) {
        PyErr_SetString(PyExc_ValueError, corrupt);
        return NULL;
    }
    return PyLong_FromLongLong(position);
failed:
    PyBuffer_Release(&data);
    return NULL;
}

/* ---- configuration ---------------------------------------------------------------------- */

PyDoc_STRVAR(configure_doc,
             "configure(event_type, kinds, limits)\n\n"
             "The StatEvent type to build, the contract's kinds ({kind: uses_delta}) and its limits (wire version,\n"
             "max value bytes, max id chars, max |delta|, earliest and latest occurred_at, future skew, in ms).\n"
             "Called once by skillstats.contract, which owns all three.");

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *type, *table;
    long long limits[7];
    if (!PyArg_ParseTuple(args, "OO!(LLLLLLL)", &type, &PyDict_Type, &table, &limits[0], &limits[1], &limits[2],
                          &limits[3], &limits[4], &limits[5], &limits[6]))
        return NULL;
    WIRE_VERSION = limits[0];
    MAX_VALUE_BYTES = limits[1];
    MAX_ID_CHARS = limits[2];
    MAX_ABS_DELTA = limits[3];
    EPOCH_2000_MS = limits[4];
    MAX_OCCURRED_AT_MS = limits[5];
    MAX_FUTURE_SKEW_MS = limits[6];
    if (PyDict_GET_SIZE(table) > MAX_KINDS) {
        PyErr_SetString(PyExc_ValueError, "too many kinds");
        return NULL;
    }
    for (int i = 0; i < kind_count; i++)
        Py_CLEAR(kinds[i].name);
    kind_count = 0;
    Py_ssize_t position = 0;
    PyObject *name, *uses_delta;
    while (PyDict_Next(table, &position, &name, &uses_delta)) {
        Py_ssize_t length;
        const char *bytes = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &length) : NULL;
        if (bytes == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "kinds must be str");
            return NULL;
        }
        Py_INCREF(name);
        kinds[kind_count].name = name;
        kinds[kind_count].bytes = bytes; /* owned by `name`, which is kept */
        kinds[kind_count].length = length;
        kinds[kind_count].uses_delta = PyObject_IsTrue(uses_delta);
        kind_count++;
        if (kinds[kind_count - 1].uses_delta < 0)
            return NULL;
    }
    Py_INCREF(type);
    Py_XSETREF(event_type, type);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, configure_doc},
    {"decode_valid", decode_valid, METH_VARARGS, decode_valid_doc},
    {"window_rows", window_rows, METH_VARARGS, window_rows_doc},
    {"fold_skills", fold_skills, METH_VARARGS, fold_skills_doc},
    {"fold_records", fold_records, METH_VARARGS, fold_records_doc},
    {"take_run", take_run, METH_VARARGS, take_run_doc},
    {"batch_columns", batch_columns, METH_VARARGS, batch_columns_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "skillstats._native",
    "The per-record hot path in C: decode's fast path, the two folds and docsync's messages (see skillstats/_native.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    str_kind = PyUnicode_InternFromString("kind");
    str_skill_id = PyUnicode_InternFromString("skill_id");
    str_occurred_at = PyUnicode_InternFromString("occurred_at");
    str_delta_all_time = PyUnicode_InternFromString("delta_all_time");
    str_delta_current = PyUnicode_InternFromString("delta_current");
    if (str_kind == NULL || str_skill_id == NULL || str_occurred_at == NULL || str_delta_all_time == NULL ||
        str_delta_current == NULL)
        return NULL;
    PyObject **names[] = {&str_error, &str_partition, &str_offset, &str_timestamp,  &str_key,
                          &str_value, &str_events,    &str_next_offset, &str_events_read};
    const char *texts[] = {"error", "partition", "offset", "timestamp", "key", "value", "events", "next_offset",
                           "events_read"};
    for (size_t j = 0; j < sizeof(texts) / sizeof(texts[0]); j++)
        if ((*names[j] = PyUnicode_InternFromString(texts[j])) == NULL)
            return NULL;
    /* The skill table's seed from this process's str hash (randomized per process unless PYTHONHASHSEED is set). */
    PyObject *seed_text = PyUnicode_FromString("skillstats._native skill table");
    if (seed_text == NULL)
        return NULL;
    Py_hash_t seed = PyObject_Hash(seed_text);
    Py_DECREF(seed_text);
    if (seed == -1)
        return NULL;
    hash_seed ^= (unsigned long long)seed;
    if (PyType_Ready(&WindowFoldType) < 0)
        return NULL;
    PyObject *created = PyModule_Create(&module);
    if (created != NULL && PyModule_AddObjectRef(created, "WindowFold", (PyObject *)&WindowFoldType) < 0)
        Py_CLEAR(created);
    /* skillstats.contract compares it with the source beside the module (an editable checkout) */
    if (created != NULL && PyModule_AddStringConstant(created, "SOURCE_SHA256", SOURCE_SHA256) < 0)
        Py_CLEAR(created);
    return created;
}
