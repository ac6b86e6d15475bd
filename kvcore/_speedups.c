/* router._speedups: the hot loops of block hashing and prefix lookups, in C.
 *
 * Each function has a pure-Python twin that gives the same results (used when this extension
 * is not built; the tests run both):
 *
 * chain_hashes(token_ids, block_size, parent) -> list[int]: for each full block of token ids,
 *     XXH3-64 of the tokens as little-endian uint32, seeded by the previous block's hash (the
 *     first by `parent`). Twin: block_hashing.chain_hashes_python. No array conversion and no
 *     Python call per block.
 * pack_u64(ints) -> bytes: ints in [0, 2**64) as native uint64. Twin: packed_runs.pack_python
 *     (array("L"/"Q", ints).tobytes(), whose conversion costs ~150 instructions an int).
 * follow(run, hashes, i, limit) -> (j, n): where hashes[i] is in run (packed uint64 hashes),
 *     and how many of hashes[i:i + limit] equal (==) the run's from there, without packing
 *     them; (-1, 0) if it is not there. Twin: packed_runs.follow_python.
 * walk(pieces, j, end, i, alive, ends) -> alive: the running AND of a run's piece values over
 *     its blocks j:end (the request's from block i on), noting in ends where it loses
 *     replicas. Twin: packed_runs.walk_python.
 * assemble(ends, low, shift, names, same, match_type) -> dict: a lookup's result per replica,
 *     from where its runs (held, and held or predicted) end. Twin: packed_runs.assemble_python.
 *
 * XXH3-64 with a seed is written here from the xxHash specification
 * (doc/xxhash_spec.md in github.com/Cyan4973/xxHash: its constants and default secret are
 * facts of the algorithm). tests/test_prefix_index.py compares it with the xxhash package for
 * every input length up to 2 KiB and more, with many seeds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint8_t u8;
typedef uint32_t u32;
typedef uint64_t u64;

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE 64
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8)
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)

static const u8 DEFAULT_SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Little-endian reads and writes, whatever the host (compilers make them single loads). */
static inline u32 read32(const u8 *p)
{
    return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24;
}

static inline u64 read64(const u8 *p)
{
    return (u64)read32(p) | (u64)read32(p + 4) << 32;
}

static inline void write64(u8 *p, u64 v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (u8)(v >> (8 * i));
    }
}

static inline u32 swap32(u32 x)
{
    return (x >> 24) | ((x >> 8) & 0xFF00U) | ((x << 8) & 0xFF0000U) | (x << 24);
}

static inline u64 swap64(u64 x)
{
    return (u64)swap32((u32)x) << 32 | swap32((u32)(x >> 32));
}

static inline u64 rotl64(u64 x, int r)
{
    return (x << r) | (x >> (64 - r));
}

/* The 128-bit product of a and b, its low and high halves xored. */
static inline u64 mul128_fold64(u64 a, u64 b)
{
#if defined(__SIZEOF_INT128__)
    __uint128_t r = (__uint128_t)a * b;
    return (u64)r ^ (u64)(r >> 64);
#else
    u64 lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    u64 hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    u64 lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    u64 hi_hi = (a >> 32) * (b >> 32);
    u64 cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    u64 upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    u64 lower = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
    return lower ^ upper;
#endif
}

static inline u64 avalanche(u64 x)
{
    x ^= x >> 37;
    x *= PRIME_MX1;
    return x ^ (x >> 32);
}

static inline u64 avalanche_xxh64(u64 x)
{
    x ^= x >> 33;
    x *= PRIME64_2;
    x ^= x >> 29;
    x *= PRIME64_3;
    return x ^ (x >> 32);
}

static inline u64 mix16(const u8 *in, const u8 *secret, u64 seed)
{
    return mul128_fold64(read64(in) ^ (read64(secret) + seed),
                         read64(in + 8) ^ (read64(secret + 8) - seed));
}

static u64 hash_0to16(const u8 *in, size_t len, u64 seed)
{
    const u8 *s = DEFAULT_SECRET;
    if (len > 8) {
        u64 lo = ((read64(s + 24) ^ read64(s + 32)) + seed) ^ read64(in);
        u64 hi = ((read64(s + 40) ^ read64(s + 48)) - seed) ^ read64(in + len - 8);
        return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
    }
    if (len >= 4) {
        u64 modified = seed ^ ((u64)swap32((u32)seed) << 32);
        u64 combined = (u64)read32(in + len - 4) | (u64)read32(in) << 32;
        u64 v = ((read64(s + 8) ^ read64(s + 16)) - modified) ^ combined;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PRIME_MX2;
        v ^= (v >> 35) + len;
        v *= PRIME_MX2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        u32 combined =
            (u32)in[len - 1] | (u32)len << 8 | (u32)in[0] << 16 | (u32)in[len >> 1] << 24;
        return avalanche_xxh64(((u64)(read32(s) ^ read32(s + 4)) + seed) ^ combined);
    }
    return avalanche_xxh64(seed ^ read64(s + 56) ^ read64(s + 64));
}

static u64 hash_17to128(const u8 *in, size_t len, u64 seed)
{
    u64 acc = len * PRIME64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = 0; i < rounds; i++) {
        acc += mix16(in + 16 * i, DEFAULT_SECRET + 32 * i, seed);
        acc += mix16(in + len - 16 * i - 16, DEFAULT_SECRET + 32 * i + 16, seed);
    }
    return avalanche(acc);
}

static u64 hash_129to240(const u8 *in, size_t len, u64 seed)
{
    u64 acc = len * PRIME64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) {
        acc += mix16(in + 16 * i, DEFAULT_SECRET + 16 * i, seed);
    }
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++) {
        acc += mix16(in + 16 * i, DEFAULT_SECRET + 16 * (i - 8) + 3, seed);
    }
    acc += mix16(in + len - 16, DEFAULT_SECRET + 119, seed);
    return avalanche(acc);
}

static inline void accumulate(u64 acc[8], const u8 *stripe, const u8 *secret)
{
    for (int i = 0; i < 8; i++) {
        u64 value = read64(stripe + 8 * i);
        u64 keyed = value ^ read64(secret + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static inline void scramble(u64 acc[8], const u8 *secret)
{
    for (int i = 0; i < 8; i++) {
        u64 a = acc[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

static u64 hash_large(const u8 *in, size_t len, u64 seed)
{
    u8 secret[SECRET_SIZE];
    for (int i = 0; i < SECRET_SIZE; i += 16) { /* the seed's own secret */
        write64(secret + i, read64(DEFAULT_SECRET + i) + seed);
        write64(secret + i + 8, read64(DEFAULT_SECRET + i + 8) - seed);
    }
    u64 acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                  PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++) {
            accumulate(acc, in + b * BLOCK + n * STRIPE, secret + n * 8);
        }
        scramble(acc, secret + SECRET_SIZE - STRIPE);
    }
    size_t stripes = (len - 1 - blocks * BLOCK) / STRIPE; /* the last block's, but its last */
    for (size_t n = 0; n < stripes; n++) {
        accumulate(acc, in + blocks * BLOCK + n * STRIPE, secret + n * 8);
    }
    accumulate(acc, in + len - STRIPE, secret + SECRET_SIZE - STRIPE - 7);
    u64 result = len * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ read64(secret + 11 + 16 * i),
                                acc[2 * i + 1] ^ read64(secret + 11 + 16 * i + 8));
    }
    return avalanche(result);
}

static u64 xxh3_64(const u8 *in, size_t len, u64 seed)
{
    if (len <= 16) {
        return hash_0to16(in, len, seed);
    }
    if (len <= 128) {
        return hash_17to128(in, len, seed);
    }
    if (len <= 240) {
        return hash_129to240(in, len, seed);
    }
    return hash_large(in, len, seed);
}

/* An exact int in [0, 2**64) read straight from its digits: 1 and the value, or 0 where the
 * public (slower: ~40 instructions a call) conversion must decide. PyLong_AsUnsignedLong was
 * most of the cost of hashing a prompt and of following a run. */
static inline int fast_u64(PyObject *item, u64 *out)
{
    if (!PyLong_CheckExact(item)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) { /* |value| < 2**30 */
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0) {
            *out = (u64)v;
            return 1;
        }
    }
    return 0;
#else /* 3.11: ob_size is the signed digit count, digits are PyLong_SHIFT (30) bits */
    const digit *d = ((PyLongObject *)item)->ob_digit;
    switch (Py_SIZE(item)) {
    case 0:
        *out = 0;
        return 1;
    case 1:
        *out = d[0];
        return 1;
    case 2:
        *out = (u64)d[0] | (u64)d[1] << PyLong_SHIFT;
        return 1;
    case 3:
        if (PyLong_SHIFT == 30 && d[2] < 16) { /* 60 + 4 bits */
            *out = (u64)d[0] | (u64)d[1] << 30 | (u64)d[2] << 60;
            return 1;
        }
        return 0;
    default:
        return 0;
    }
#endif
}

/* A token id that is an exact int below 2**30 (all of them in practice), read in place. */
static inline int small_u32(PyObject *item, u32 *out)
{
    if (!PyLong_CheckExact(item)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0 && v <= 0xFFFFFFFF) {
            *out = (u32)v;
            return 1;
        }
    }
    return 0;
#else
    Py_ssize_t size = Py_SIZE(item);
    if (size == 1) {
        *out = ((PyLongObject *)item)->ob_digit[0];
        return 1;
    }
    if (size == 0) {
        *out = 0;
        return 1;
    }
    return 0;
#endif
}

/* A token id as uint32, with array("I")'s errors: TypeError for a non-integer, OverflowError
 * outside [0, 2**32). */
static int token_u32(PyObject *item, u32 *out)
{
    unsigned long v;
    u64 fast;
    if (fast_u64(item, &fast) && fast <= 0xFFFFFFFFULL) {
        *out = (u32)fast;
        return 0;
    }
    if (PyLong_Check(item)) {
        v = PyLong_AsUnsignedLong(item);
    }
    else { /* __index__ may run code: keep the item alive through it */
        Py_INCREF(item);
        PyObject *index = PyNumber_Index(item);
        Py_DECREF(item);
        if (index == NULL) {
            return -1;
        }
        v = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
    }
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (v > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
        return -1;
    }
    *out = (u32)v;
    return 0;
}

static PyObject *chain_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain_hashes(token_ids, block_size, parent)");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (block_size < 1 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "parent must be an int");
        return NULL;
    }
    u64 parent = PyLong_AsUnsignedLongLongMask(args[2]); /* as xxhash takes a seed */
    if (parent == (u64)-1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "token_ids must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) / block_size;
    PyObject *out = PyList_New(n);
    u8 *buf = n ? PyMem_Malloc((size_t)block_size * 4) : NULL;
    if (out == NULL || (n && buf == NULL)) {
        if (out != NULL && buf == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        Py_ssize_t k = b * block_size, stop = k + block_size;
        if (stop > PySequence_Fast_GET_SIZE(seq)) { /* an __index__ shrank the list */
            PyErr_SetString(PyExc_RuntimeError, "token_ids changed size while hashed");
            goto fail;
        }
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (u8 *p = buf; k < stop; k++, p += 4) {
            u32 token;
            if (!small_u32(items[k], &token)) { /* the general path: it may run __index__ */
                if (token_u32(items[k], &token) < 0) {
                    goto fail;
                }
                if (stop > PySequence_Fast_GET_SIZE(seq)) {
                    PyErr_SetString(PyExc_RuntimeError, "token_ids changed size while hashed");
                    goto fail;
                }
                items = PySequence_Fast_ITEMS(seq);
            }
#if PY_LITTLE_ENDIAN
            memcpy(p, &token, 4);
#else
            p[0] = (u8)token;
            p[1] = (u8)(token >> 8);
            p[2] = (u8)(token >> 16);
            p[3] = (u8)(token >> 24);
#endif
        }
        parent = xxh3_64(buf, (size_t)block_size * 4, parent);
        PyObject *h = PyLong_FromUnsignedLongLong(parent);
        if (h == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, b, h);
    }
    PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(buf);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* An int in [0, 2**64), with array("Q")'s errors: TypeError for a non-integer, OverflowError
 * outside. */
static int as_u64(PyObject *item, u64 *out)
{
    if (fast_u64(item, out)) {
        return 0;
    }
    PyObject *value = item;
    if (!PyLong_Check(item)) { /* __index__ may run code: keep the item alive through it */
        Py_INCREF(item);
        value = PyNumber_Index(item);
        Py_DECREF(item);
        if (value == NULL) {
            return -1;
        }
    }
    else {
        Py_INCREF(value);
    }
#if ULONG_MAX == 0xFFFFFFFFFFFFFFFFULL
    u64 v = PyLong_AsUnsignedLong(value); /* a faster path than ...LongLong in CPython 3.11 */
#else
    u64 v = PyLong_AsUnsignedLongLong(value);
#endif
    Py_DECREF(value);
    if (v == (u64)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *pack_u64(PyObject *module, PyObject *seq_arg)
{
    (void)module;
    PyObject *seq = PySequence_Fast(seq_arg, "pack_u64 takes a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > PY_SSIZE_T_MAX / 8) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k >= PySequence_Fast_GET_SIZE(seq)) { /* an __index__ resized a list */
            PyErr_SetString(PyExc_RuntimeError, "the sequence changed size while packed");
            goto fail;
        }
        u64 v;
        if (as_u64(PySequence_Fast_ITEMS(seq)[k], &v) < 0) {
            goto fail;
        }
        memcpy(dst + 8 * k, &v, 8); /* native order, as array("Q") */
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static inline u64 run_word(const char *run, Py_ssize_t k)
{
    u64 w;
    memcpy(&w, run + 8 * k, 8);
    return w;
}

/* (a, b) as a new tuple of ints. */
static PyObject *pair_of(Py_ssize_t a, Py_ssize_t b)
{
    PyObject *pair = PyTuple_New(2);
    PyObject *x = PyLong_FromSsize_t(a), *y = PyLong_FromSsize_t(b);
    if (pair == NULL || x == NULL || y == NULL) {
        Py_XDECREF(pair);
        Py_XDECREF(x);
        Py_XDECREF(y);
        return NULL;
    }
    PyTuple_SET_ITEM(pair, 0, x);
    PyTuple_SET_ITEM(pair, 1, y);
    return pair;
}

/* An exact int as a run word: 1 and *out for one in [0, 2**64), 0 for one outside (no run holds
 * it), 2 for anything that is not an exact int (compare it with equals_word), -1 on an error.
 * On 3.12+ fast_u64 only reads ints below 2**30: this converts a hash once, not per word. */
static inline int exact_u64(PyObject *item, u64 *out)
{
    if (fast_u64(item, out)) {
        return 1;
    }
    if (!PyLong_CheckExact(item)) {
        return 2;
    }
#if ULONG_MAX == 0xFFFFFFFFFFFFFFFFULL
    u64 v = PyLong_AsUnsignedLong(item); /* a faster path than ...LongLong in CPython 3.11 */
#else
    u64 v = PyLong_AsUnsignedLongLong(item);
#endif
    if (v == (u64)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear(); /* negative, or 2**64 and above */
        return 0;
    }
    *out = v;
    return 1;
}

/* Whether item == the run hash w, as Python compares them: 1, 0, or -1 on an error. Only for
 * items that are not exact ints (exact_u64 settles those): int subclasses, floats, ... */
static inline int equals_word(PyObject *item, u64 w)
{
    PyObject *hash = PyLong_FromUnsignedLongLong(w);
    if (hash == NULL) {
        return -1;
    }
    Py_INCREF(item); /* its __eq__ may run code */
    int eq = PyObject_RichCompareBool(item, hash, Py_EQ);
    Py_DECREF(item);
    Py_DECREF(hash);
    return eq;
}

static PyObject *follow(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "follow(run: bytes, hashes, i, limit)");
        return NULL;
    }
    /* Clipped to the Py_ssize_t range, as the Python twin's range checks treat huge ones. */
    Py_ssize_t i = PyNumber_AsSsize_t(args[2], NULL);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t limit = PyNumber_AsSsize_t(args[3], NULL);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    PyObject *run_obj = args[0];
    Py_INCREF(run_obj);
    const char *run = PyBytes_AS_STRING(run_obj);
    Py_ssize_t words = PyBytes_GET_SIZE(run_obj) / 8;
    Py_ssize_t j = -1, n = 0;
    int eq = 0;
    /* Items are read through the sequence each time: an __eq__ could resize a list. */
    if (i >= 0 && i < PySequence_Fast_GET_SIZE(seq) && limit > 0) {
        u64 h;
        PyObject *first = PySequence_Fast_ITEMS(seq)[i];
        int kind = exact_u64(first, &h);
        if (kind < 0) {
            eq = -1;
        }
        else if (kind == 1) { /* the usual case: one compare a word */
            for (Py_ssize_t k = 0; k < words && j < 0; k++) {
                if (run_word(run, k) == h) {
                    j = k;
                }
            }
        }
        else if (kind == 2) {
            Py_INCREF(first);
            for (Py_ssize_t k = 0; k < words && j < 0; k++) {
                eq = equals_word(first, run_word(run, k));
                if (eq < 0) {
                    break;
                }
                if (eq) {
                    j = k;
                }
            }
            Py_DECREF(first);
        }
    }
    if (j >= 0) {
        Py_ssize_t most = words - j;
        if (limit < most) {
            most = limit;
        }
        if (PySequence_Fast_GET_SIZE(seq) - i < most) {
            most = PySequence_Fast_GET_SIZE(seq) - i;
        }
        n = 1;
        while (n < most && n < PySequence_Fast_GET_SIZE(seq) - i) {
            PyObject *item = PySequence_Fast_ITEMS(seq)[i + n];
            u64 v;
            int kind = exact_u64(item, &v);
            if (kind == 1) { /* the usual case: one word compare */
                if (v != run_word(run, j + n)) {
                    break;
                }
            }
            else if (kind == 0) {
                break;
            }
            else if (kind < 0) {
                eq = -1;
                break;
            }
            else { /* as Python compares; it may run code, so the sequence is read again */
                eq = equals_word(item, run_word(run, j + n));
                if (eq <= 0) {
                    break;
                }
            }
            n++;
        }
    }
    Py_DECREF(run_obj);
    Py_DECREF(seq);
    if (eq < 0) {
        return NULL;
    }
    return pair_of(j, n);
}

/* The index of the lowest set bit of a non-zero word. */
static inline int lowest_bit(u64 x)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(x);
#else
    int n = 0;
    while (!(x & 1)) {
        x >>= 1;
        n++;
    }
    return n;
#endif
}

/* The set bits of a non-negative int below 2**count into set[] (room for count), lowest first:
 * how many, or -1 with an exception (IndexError for a bit >= count, as names[k] would raise). */
static Py_ssize_t mask_bits(PyObject *mask, Py_ssize_t count, Py_ssize_t *set)
{
    Py_ssize_t found = 0, base = 0;
#if PY_VERSION_HEX < 0x030C0000
    /* 3.11: a non-negative exact int's digits, read in place */
    if (PyLong_CheckExact(mask) && Py_SIZE(mask) >= 0) {
        const digit *d = ((PyLongObject *)mask)->ob_digit;
        for (Py_ssize_t k = 0; k < Py_SIZE(mask); k++, base += PyLong_SHIFT) {
            for (u64 chunk = d[k]; chunk; chunk &= chunk - 1) {
                Py_ssize_t bit = base + lowest_bit(chunk);
                if (bit >= count) {
                    PyErr_SetString(PyExc_IndexError, "a mask bit has no name");
                    return -1;
                }
                set[found++] = bit;
            }
        }
        return found;
    }
#endif
    /* 64 bits at a time (int.to_bytes costs ~10x more to call). */
    PyObject *rest = mask, *sixty_four = NULL;
    Py_INCREF(rest);
    for (;;) {
        int more = PyObject_IsTrue(rest);
        if (more < 0) {
            goto fail;
        }
        if (!more) {
            break;
        }
        u64 chunk = PyLong_AsUnsignedLongLongMask(rest);
        if (chunk == (u64)-1 && PyErr_Occurred()) {
            goto fail;
        }
        for (; chunk; chunk &= chunk - 1) {
            int low = lowest_bit(chunk);
            if (base + low >= count) { /* also a negative mask: its ones never end */
                PyErr_SetString(PyExc_IndexError, "a mask bit has no name");
                goto fail;
            }
            set[found++] = base + low;
        }
        if (sixty_four == NULL && (sixty_four = PyLong_FromLong(64)) == NULL) {
            goto fail;
        }
        PyObject *shifted = PyNumber_Rshift(rest, sixty_four);
        Py_DECREF(rest);
        rest = shifted;
        if (rest == NULL) {
            goto fail;
        }
        base += 64;
    }
    Py_DECREF(rest);
    Py_XDECREF(sixty_four);
    return found;
fail:
    Py_XDECREF(rest);
    Py_XDECREF(sixty_four);
    return -1;
}

/* match_type(a, b) for a tuple subclass (a NamedTuple), as tuple.__new__ makes it. */
static PyObject *new_match(PyTypeObject *match_type, Py_ssize_t a, Py_ssize_t b)
{
    PyObject *x = PyLong_FromSsize_t(a), *y = PyLong_FromSsize_t(b);
    PyObject *pair = x && y ? PyTuple_Pack(2, x, y) : NULL;
    Py_XDECREF(x);
    Py_XDECREF(y);
    PyObject *args = pair ? PyTuple_Pack(1, pair) : NULL;
    Py_XDECREF(pair);
    if (args == NULL) {
        return NULL;
    }
    PyObject *m = PyTuple_Type.tp_new(match_type, args, NULL);
    Py_DECREF(args);
    return m;
}

static PyObject *assemble(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6 || !PyList_Check(args[0]) || !PyLong_Check(args[1]) ||
        !PyLong_Check(args[2]) || !PyList_Check(args[3]) || !PyList_Check(args[4]) ||
        !PyType_Check(args[5]) ||
        !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "assemble(ends: list, low: int, shift: int, "
                                         "names: list, same: list, match_type: type)");
        return NULL;
    }
    PyObject *ends = args[0], *low = args[1], *shift = args[2], *names = args[3];
    PyObject *same = args[4];
    PyTypeObject *match_type = (PyTypeObject *)args[5];
    Py_ssize_t count = PyList_GET_SIZE(names);
    Py_ssize_t room = count > 0 ? count : 1;
    Py_ssize_t *set = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)room);
    Py_ssize_t *confirmed = PyMem_Calloc((size_t)room, sizeof(Py_ssize_t));
    PyObject *out = PyDict_New();
    PyObject *item = NULL, *held = NULL, *both = NULL;
    if (set == NULL || confirmed == NULL || out == NULL) {
        if (out != NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (Py_ssize_t e = 0; e < PyList_GET_SIZE(ends); e++) {
        item = PyList_GET_ITEM(ends, e);
        Py_INCREF(item);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "ends holds (length, mask) pairs");
            goto fail;
        }
        Py_ssize_t length = PyNumber_AsSsize_t(PyTuple_GET_ITEM(item, 0), PyExc_OverflowError);
        if (length == -1 && PyErr_Occurred()) {
            goto fail;
        }
        PyObject *mask = PyTuple_GET_ITEM(item, 1);
        held = PyNumber_And(mask, low);
        both = held ? PyNumber_Rshift(mask, shift) : NULL;
        if (both == NULL) {
            goto fail;
        }
        /* Held runs that end here first: a replica whose runs both end here has the same
         * length twice (same[length], shared), else (length, where its held run ended). */
        Py_ssize_t n = mask_bits(held, count, set);
        if (n < 0) {
            goto fail;
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            confirmed[set[k]] = length;
        }
        n = mask_bits(both, count, set);
        if (n < 0) {
            goto fail;
        }
        while (n > 0) { /* highest first, as the Python twin */
            Py_ssize_t k = set[--n];
            Py_ssize_t c = confirmed[k];
            PyObject *value;
            if (c == length) {
                if (length < 0 || length >= PyList_GET_SIZE(same)) {
                    PyErr_SetString(PyExc_IndexError, "same has no entry for that length");
                    goto fail;
                }
                value = PyList_GET_ITEM(same, length);
                Py_INCREF(value);
            }
            else if ((value = new_match(match_type, length, c)) == NULL) {
                goto fail;
            }
            if (k >= PyList_GET_SIZE(names)) {
                Py_DECREF(value);
                PyErr_SetString(PyExc_IndexError, "the names changed during assemble");
                goto fail;
            }
            PyObject *name = PyList_GET_ITEM(names, k);
            Py_INCREF(name);
            int rc = PyDict_SetItem(out, name, value);
            Py_DECREF(name);
            Py_DECREF(value);
            if (rc < 0) {
                goto fail;
            }
        }
        Py_CLEAR(held);
        Py_CLEAR(both);
        Py_CLEAR(item);
    }
    PyMem_Free(set);
    PyMem_Free(confirmed);
    return out;
fail:
    Py_XDECREF(item);
    Py_XDECREF(held);
    Py_XDECREF(both);
    Py_XDECREF(out);
    PyMem_Free(set);
    PyMem_Free(confirmed);
    return NULL;
}

/* A piece's start: the odd items of a pieces tuple are small non-negative ints. */
static inline Py_ssize_t piece_start(PyObject *pieces, Py_ssize_t t)
{
    Py_ssize_t start = PyNumber_AsSsize_t(PyTuple_GET_ITEM(pieces, t), PyExc_OverflowError);
    if (start == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (start < 0 || start > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "walk: a piece starts outside [0, PY_SSIZE_T_MAX / 4]");
        return -1;
    }
    return start;
}

static PyObject *walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) % 2 != 1 ||
        !PyLong_Check(args[4]) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "walk(pieces: tuple, j, end, i, alive: int, ends: list)");
        return NULL;
    }
    PyObject *pieces = args[0], *ends = args[5];
    Py_ssize_t j = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (j == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t end = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (end == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t i = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* Positions in a run and a request (thousands at most): i + start - j cannot overflow. */
    if (i < 0 || j < 0 || end < 0 || i > PY_SSIZE_T_MAX / 4 || j > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "walk: positions must lie in [0, PY_SSIZE_T_MAX / 4]");
        return NULL;
    }
    Py_ssize_t last = PyTuple_GET_SIZE(pieces) - 1, t = 0, at = i, start;
    while (t < last) {
        if ((start = piece_start(pieces, t + 1)) == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (start > j) {
            break;
        }
        t += 2;
    }
    PyObject *alive = args[4];
    Py_INCREF(alive);
    for (;;) {
        PyObject *value = PyTuple_GET_ITEM(pieces, t);
        if (at) {
            PyObject *kept = PyNumber_And(alive, value);
            if (kept == NULL) {
                goto fail;
            }
            int same = PyObject_RichCompareBool(kept, alive, Py_EQ);
            if (same < 0) {
                Py_DECREF(kept);
                goto fail;
            }
            if (!same) {
                PyObject *lost = PyNumber_Xor(alive, kept);
                PyObject *where = PyLong_FromSsize_t(at);
                PyObject *pair = lost && where ? PyTuple_New(2) : NULL;
                if (pair == NULL) {
                    Py_XDECREF(lost);
                    Py_XDECREF(where);
                    Py_DECREF(kept);
                    goto fail;
                }
                PyTuple_SET_ITEM(pair, 0, where);
                PyTuple_SET_ITEM(pair, 1, lost);
                int appended = PyList_Append(ends, pair);
                Py_DECREF(pair);
                if (appended < 0) {
                    Py_DECREF(kept);
                    goto fail;
                }
                Py_DECREF(alive);
                alive = kept;
                int any = PyObject_IsTrue(alive);
                if (any <= 0) {
                    if (any < 0) {
                        goto fail;
                    }
                    break;
                }
            }
            else {
                Py_DECREF(kept);
            }
        }
        else { /* the request's first block */
            Py_INCREF(value);
            Py_DECREF(alive);
            alive = value;
        }
        if (t == last) {
            break;
        }
        if ((start = piece_start(pieces, t + 1)) == -1 && PyErr_Occurred()) {
            goto fail;
        }
        if (start >= end) {
            break;
        }
        at = i + start - j;
        t += 2;
    }
    return alive;
fail:
    Py_DECREF(alive);
    return NULL;
}

/* xxh3_64(data, seed) -> int: one XXH3-64 digest, for the tests against the xxhash package. */
static PyObject *xxh3_64_digest(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64(data: bytes-like, seed: int)");
        return NULL;
    }
    u64 seed = PyLong_AsUnsignedLongLongMask(args[1]);
    if (seed == (u64)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    u64 h = xxh3_64((const u8 *)view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"chain_hashes", (PyCFunction)(void (*)(void))chain_hashes, METH_FASTCALL,
     "Chained XXH3-64 hashes of the full blocks of token_ids (see router.block_hashing)."},
    {"xxh3_64", (PyCFunction)(void (*)(void))xxh3_64_digest, METH_FASTCALL,
     "XXH3-64 of a bytes-like object with a seed."},
    {"pack_u64", pack_u64, METH_O, "Ints in [0, 2**64) as native uint64 bytes."},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "AND the values of the pieces over blocks j:end into alive, noting where it loses bits."},
    {"assemble", (PyCFunction)(void (*)(void))assemble, METH_FASTCALL,
     "A lookup's result from where replicas' runs end (see packed_runs.assemble_python)."},
    {"follow", (PyCFunction)(void (*)(void))follow, METH_FASTCALL,
     "(j, n): where hashes[i] is in run, and how many hashes on are the run's (at most limit)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_speedups",
    .m_doc = "Hot loops of block hashing and prefix lookups.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    return PyModule_Create(&module_def);
}
