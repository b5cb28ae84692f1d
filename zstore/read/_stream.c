/* Copies whose destination will not be read soon (a batch buffer the training step reads
 * after the whole batch is filled), written with non-temporal stores: they go to memory
 * without first reading the destination's cache lines and without evicting the cache.
 * Measured on this project's benchmark machine: a 10 s 8-mic window (5.1 MB) from a
 * mapped tmpfs shard into a batch buffer, ~710 us with memcpy, ~410 us streamed (AVX-512
 * stores of whole cache lines; ~580 us with SSE2's 16-byte stores).
 *
 * stream_copy(dst, src): dst and src are buffers of the same shape and item size whose
 * last axis is contiguous (numpy slices along the other axes are fine).  The GIL is
 * released while copying.  Elsewhere than x86-64 (gcc or clang) it is a plain memcpy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define ZS_STREAM 1
#endif

#ifdef ZS_STREAM
#include <immintrin.h>

/* One cache line: a single 64-byte store where the CPU has AVX-512 (a whole line written
 * at once is what non-temporal stores do best), else four 16-byte stores. */
__attribute__((target("avx512f"))) static inline void line_avx512(char *d, const char *s) {
    _mm512_stream_si512((__m512i *)d, _mm512_loadu_si512((const void *)s));
}

static inline void line_sse2(char *d, const char *s) {
    for (size_t q = 0; q < 64; q += 16)
        _mm_stream_si128((__m128i *)(d + q), _mm_loadu_si128((const __m128i *)(s + q)));
}

/* Like glibc's large copies: four pages at a time, interleaved, so that several streams
 * of memory are in flight at once; then the lines left. */
#define LINES(NAME, LINE, ATTR)                                                            \
    ATTR static void NAME(char *dst, const char *src, size_t lines) {                      \
        const size_t per_page = 4096 / 64;                                                 \
        size_t i = 0;                                                                      \
        for (; i + 4 * per_page <= lines; i += 4 * per_page)                               \
            for (size_t j = 0; j < per_page; j++)                                          \
                for (size_t p = 0; p < 4; p++) {                                           \
                    size_t at = (i + p * per_page + j) * 64;                               \
                    LINE(dst + at, src + at);                                              \
                }                                                                          \
        for (; i < lines; i++)                                                             \
            LINE(dst + i * 64, src + i * 64);                                              \
    }

LINES(lines_avx512, line_avx512, __attribute__((target("avx512f"))))
LINES(lines_sse2, line_sse2, )

static void (*copy_lines)(char *, const char *, size_t) = lines_sse2;
#endif

static void stream_row(char *dst, const char *src, size_t n) {
#ifdef ZS_STREAM
    /* up to the first 64-byte line of dst as usual, whole lines streamed, the rest */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t lines = (n - head) / 64;
    copy_lines(dst + head, src + head, lines);
    size_t done = head + lines * 64;
    memcpy(dst + done, src + done, n - done);
#else
    memcpy(dst, src, n);
#endif
}

/* Copy every row (the last axis) of src into dst, walking the leading axes. */
static void copy_rows(char *dst, const char *src, int ndim, const Py_ssize_t *shape,
                      const Py_ssize_t *dst_strides, const Py_ssize_t *src_strides,
                      size_t row_bytes) {
    if (ndim <= 1) {
        stream_row(dst, src, row_bytes);
        return;
    }
    for (Py_ssize_t k = 0; k < shape[0]; k++)
        copy_rows(dst + k * dst_strides[0], src + k * src_strides[0], ndim - 1, shape + 1,
                  dst_strides + 1, src_strides + 1, row_bytes);
}

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO:stream_copy", &dst_obj, &src_obj))
        return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    const char *problem = NULL;
    if (dst.ndim != src.ndim || dst.itemsize != src.itemsize)
        problem = "stream_copy: dst and src differ in dimensions or item size";
    for (int k = 0; !problem && k < dst.ndim; k++)
        if (dst.shape[k] != src.shape[k])
            problem = "stream_copy: dst and src differ in shape";
    if (!problem && dst.ndim > 0 &&
        (dst.strides[dst.ndim - 1] != dst.itemsize || src.strides[src.ndim - 1] != src.itemsize))
        problem = "stream_copy: the last axis of dst and src must be contiguous";
    if (problem) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int empty = 0;
    for (int k = 0; k < dst.ndim; k++)
        empty |= dst.shape[k] == 0;
    if (!empty) {
        size_t row = (size_t)dst.itemsize * (dst.ndim ? (size_t)dst.shape[dst.ndim - 1] : 1);
        Py_BEGIN_ALLOW_THREADS
        copy_rows((char *)dst.buf, (const char *)src.buf, dst.ndim, dst.shape, dst.strides,
                  src.strides, row);
#ifdef ZS_STREAM
        _mm_sfence(); /* the streamed stores are visible before anyone is told */
#endif
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* stores() names the stores in use; use(name) picks "sse2" or "avx512" (where the CPU has
 * it), for tests of both paths. */
static PyObject *stores(PyObject *self, PyObject *args) {
#ifdef ZS_STREAM
    return PyUnicode_FromString(copy_lines == lines_avx512 ? "avx512" : "sse2");
#else
    return PyUnicode_FromString("memcpy");
#endif
}

static PyObject *use(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use", &name))
        return NULL;
#ifdef ZS_STREAM
    if (strcmp(name, "sse2") == 0) {
        copy_lines = lines_sse2;
        Py_RETURN_NONE;
    }
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        copy_lines = lines_avx512;
        Py_RETURN_NONE;
    }
#endif
    PyErr_Format(PyExc_ValueError, "use: stores '%s' are not available here", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"stores", stores, METH_NOARGS, "stores(): the stores in use: avx512, sse2 or memcpy."},
    {"use", use, METH_VARARGS, "use(name): copy with 'sse2' or 'avx512' stores (tests)."},
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src): copy src into dst (same shape and item size, last axis "
     "contiguous) with non-temporal stores, the GIL released."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "zstore._stream",
                                    "Streamed (non-temporal) copies into batch buffers.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__stream(void) {
#ifdef ZS_STREAM
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        copy_lines = lines_avx512;
#endif
    return PyModule_Create(&module);
}
