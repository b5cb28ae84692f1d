/* Copies whose destination will not be read soon (a batch buffer the training step reads
 * after the whole batch is filled), written with non-temporal stores: they go to memory
 * without first reading the destination's cache lines and without evicting the cache.
 * Measured on this project's benchmark machine: a 10 s 8-mic window (5.1 MB) from a
 * mapped tmpfs shard into a batch buffer, ~710 us with memcpy, ~410 us streamed (AVX-512
 * stores of whole cache lines; ~580 us with SSE2's 16-byte stores).
 *
 * stream_copy(dst, src): dst and src are buffers of the same shape and item size whose
 * last axis is contiguous (numpy slices along the other axes are fine).  The GIL is
 * released while copying.  Elsewhere than x86-64 (gcc or clang) it is a plain memcpy.
 *
 * gather(dsts, srcs, parts, pads, axis, stream_min): a batch of short windows in one call,
 * from a table of (dst, src, start, samples, start in dst) rows; a numpy slice and copy
 * per window cost ~5 us of Python, more than copying a 1 s mono window. */
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

/* Every row (the last axis) of src into dst, walking the leading axes: rows of
 * stream_min bytes or more streamed, shorter ones with memcpy; zeros where src is NULL. */
static void block_rows(char *dst, const char *src, int ndim, const Py_ssize_t *shape,
                       const Py_ssize_t *ds, const Py_ssize_t *ss, size_t row, size_t stream_min) {
    if (ndim <= 1) {
        if (src == NULL)
            memset(dst, 0, row);
        else if (row >= stream_min)
            stream_row(dst, src, row);
        else
            memcpy(dst, src, row);
        return;
    }
    for (Py_ssize_t k = 0; k < shape[0]; k++)
        block_rows(dst + k * ds[0], src == NULL ? NULL : src + k * ss[0], ndim - 1, shape + 1,
                   ds + 1, ss == NULL ? NULL : ss + 1, row, stream_min);
}

/* A buffer's struct format without its byte-order prefix ("B" where it has none). */
static const char *format_of(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    return (*f == '<' || *f == '=' || *f == '@') ? f + 1 : f;
}

static int is_empty(const Py_buffer *v) {
    for (int k = 0; k < v->ndim; k++)
        if (v->shape[k] == 0)
            return 1;
    return 0;
}

/* Why dst and src of one call cannot be walked row by row together (NULL: they can):
 * the same dimensions and shape, the last axis of each contiguous. */
static const char *pair_problem(const Py_buffer *dst, const Py_buffer *src) {
    if (dst->ndim != src->ndim)
        return "dst and src differ in dimensions";
    for (int k = 0; k < dst->ndim; k++)
        if (dst->shape[k] != src->shape[k])
            return "dst and src differ in shape";
    if (dst->ndim > 0 && (dst->strides[dst->ndim - 1] != dst->itemsize ||
                          src->strides[src->ndim - 1] != src->itemsize))
        return "the last axis of dst and src must be contiguous";
    return NULL;
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
    const char *problem = dst.ndim != src.ndim || dst.itemsize != src.itemsize
                              ? "dst and src differ in dimensions or item size"
                              : pair_problem(&dst, &src);
    if (problem) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "stream_copy: %s", problem);
        return NULL;
    }
    if (!is_empty(&dst)) {
        size_t row = (size_t)dst.itemsize * (dst.ndim ? (size_t)dst.shape[dst.ndim - 1] : 1);
        Py_BEGIN_ALLOW_THREADS
        block_rows((char *)dst.buf, (const char *)src.buf, dst.ndim, dst.shape, dst.strides,
                   src.strides, row, 0);
#ifdef ZS_STREAM
        _mm_sfence(); /* the streamed stores are visible before anyone is told */
#endif
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* Axes merged from the last where both sides are contiguous across them (fewer, longer
 * rows); ss NULL: dst's alone (a zero fill). */
#define ZS_MAX_DIMS 32

static int merge_axes(int ndim, Py_ssize_t *shape, Py_ssize_t *ds, Py_ssize_t *ss) {
    while (ndim > 1 && ds[ndim - 2] == shape[ndim - 1] * ds[ndim - 1] &&
           (ss == NULL || ss[ndim - 2] == shape[ndim - 1] * ss[ndim - 1])) {
        shape[ndim - 2] *= shape[ndim - 1];
        ds[ndim - 2] = ds[ndim - 1];
        if (ss != NULL)
            ss[ndim - 2] = ss[ndim - 1];
        ndim--;
    }
    return ndim;
}

static void widen_rows(char *dst, const char *src, int ndim, const Py_ssize_t *shape,
                       const Py_ssize_t *ds, const Py_ssize_t *ss, int wide, size_t stream_min);

/* dst's slice [at, at + n) along axis (src's [lo, lo + n), or zeros where src is NULL);
 * an int16 src into a float dst is widened (samples, x * 2**-15). */
static void copy_span(const Py_buffer *dst, const Py_buffer *src, int axis, Py_ssize_t at,
                      Py_ssize_t lo, Py_ssize_t n, size_t stream_min) {
    Py_ssize_t shape[ZS_MAX_DIMS], ds[ZS_MAX_DIMS], ss[ZS_MAX_DIMS];
    int ndim = dst->ndim;
    for (int k = 0; k < ndim; k++) {
        shape[k] = k == axis ? n : dst->shape[k];
        ds[k] = dst->strides[k];
        ss[k] = src == NULL ? 0 : src->strides[k];
        if (shape[k] == 0)
            return;
    }
    char *d = (char *)dst->buf + at * dst->strides[axis];
    const char *s = src == NULL ? NULL : (const char *)src->buf + lo * src->strides[axis];
    ndim = merge_axes(ndim, shape, ds, src == NULL ? NULL : ss);
    if (src != NULL && src->itemsize != dst->itemsize) {
        widen_rows(d, s, ndim, shape, ds, ss, (int)dst->itemsize, stream_min);
        return;
    }
    size_t row = (size_t)shape[ndim - 1] * (size_t)dst->itemsize;
    block_rows(d, s, ndim, shape, ds, src == NULL ? NULL : ss, row, stream_min);
}

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
}

/* Buffers of every object of a sequence (writable ones for dsts); NULL on an error. */
static Py_buffer *buffers_of(PyObject *seq, Py_ssize_t *count, int writable) {
    PyObject *fast = PySequence_Fast(seq, "gather: dsts and srcs must be sequences");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, k), &views[k], flags) < 0) {
            release_all(views, k);
            Py_DECREF(fast);
            return NULL;
        }
        if (views[k].ndim < 1 || views[k].ndim > ZS_MAX_DIMS ||
            views[k].strides[views[k].ndim - 1] != views[k].itemsize) {
            release_all(views, k + 1);
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError,
                            "gather: every array needs 1 to 32 axes, the last contiguous");
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return views;
}

/* An (m, cols) table of int64 as a C-contiguous buffer. */
static int table_of(PyObject *obj, Py_buffer *view, Py_ssize_t cols, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = format_of(view);
    int int64 = view->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    if (!int64 || view->ndim != 2 || view->shape[1] != cols) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "gather: %s must be an (m, %zd) int64 array", what, cols);
        return -1;
    }
    return 0;
}

static int is_float(const Py_buffer *v) {
    const char *f = format_of(v);
    return (strcmp(f, "f") == 0 && v->itemsize == 4) || (strcmp(f, "d") == 0 && v->itemsize == 8);
}

static int is_int16(const Py_buffer *v) {
    return strcmp(format_of(v), "h") == 0 && v->itemsize == 2;
}

/* A dst and its src of one dtype, or int16 samples into a float dst (widened). */
static const char *same_format(const Py_buffer *a, const Py_buffer *b) {
    const char *fa = a->format ? a->format : "B", *fb = b->format ? b->format : "B";
    int widened = is_float(a) && is_int16(b);
    if (!widened && (a->itemsize != b->itemsize || strcmp(fa, fb) != 0))
        return "gather: a dst and its src differ in dtype (other than int16 into float)";
    if (a->ndim != b->ndim)
        return "gather: a dst and its src differ in dimensions";
    return NULL;
}

/* gather(dsts, srcs, parts, pads, axis, stream_min): for each row (d, s, lo, n, at) of
 * parts, dsts[d][..., at:at + n, ...] = srcs[s][..., lo:lo + n, ...] along axis; for
 * each row (d, at) of pads, zeros in dsts[d] from at to the end of axis; an int16 src of
 * a float dst is widened (int16 samples in the RAM tier).  Every row is
 * checked before anything is written; rows of stream_min bytes or more are streamed; the
 * GIL is released while copying. */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *dsts_obj, *srcs_obj, *parts_obj, *pads_obj;
    int axis;
    Py_ssize_t stream_min;
    if (!PyArg_ParseTuple(args, "OOOOin:gather", &dsts_obj, &srcs_obj, &parts_obj, &pads_obj,
                          &axis, &stream_min))
        return NULL;
    Py_ssize_t nd = 0, ns = 0;
    Py_buffer parts, pads;
    Py_buffer *dsts = buffers_of(dsts_obj, &nd, 1);
    if (dsts == NULL)
        return NULL;
    Py_buffer *srcs = buffers_of(srcs_obj, &ns, 0);
    if (srcs == NULL) {
        release_all(dsts, nd);
        return NULL;
    }
    if (table_of(parts_obj, &parts, 5, "parts") < 0) {
        release_all(dsts, nd);
        release_all(srcs, ns);
        return NULL;
    }
    if (table_of(pads_obj, &pads, 2, "pads") < 0) {
        PyBuffer_Release(&parts);
        release_all(dsts, nd);
        release_all(srcs, ns);
        return NULL;
    }
    const int64_t *p = parts.buf, *z = pads.buf;
    Py_ssize_t np_ = parts.shape[0], nz = pads.shape[0];
    const char *problem = NULL;
    for (Py_ssize_t r = 0; !problem && r < np_; r++) {
        const int64_t *row = p + 5 * r;
        if (row[0] < 0 || row[0] >= nd || row[1] < 0 || row[1] >= ns) {
            problem = "gather: a part names a dst or src that is not there";
            break;
        }
        const Py_buffer *d = &dsts[row[0]], *s = &srcs[row[1]];
        problem = same_format(d, s);
        if (problem)
            break;
        if (axis < 0 || axis >= d->ndim) {
            problem = "gather: axis is not an axis of the arrays";
            break;
        }
        for (int k = 0; !problem && k < d->ndim; k++)
            if (k != axis && d->shape[k] != s->shape[k])
                problem = "gather: a dst and its src differ in shape off the axis";
        if (!problem && (row[2] < 0 || row[3] < 0 || row[4] < 0 ||
                         row[2] + row[3] > s->shape[axis] || row[4] + row[3] > d->shape[axis]))
            problem = "gather: a part reaches outside its src or dst";
    }
    for (Py_ssize_t r = 0; !problem && r < nz; r++) {
        const int64_t *row = z + 2 * r;
        if (row[0] < 0 || row[0] >= nd)
            problem = "gather: a pad names a dst that is not there";
        else if (axis < 0 || axis >= dsts[row[0]].ndim)
            problem = "gather: axis is not an axis of the arrays";
        else if (row[1] < 0 || row[1] > dsts[row[0]].shape[axis])
            problem = "gather: a pad starts outside its dst";
    }
    if (!problem) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < np_; r++) {
            const int64_t *row = p + 5 * r;
            copy_span(&dsts[row[0]], &srcs[row[1]], axis, row[4], row[2], row[3],
                      (size_t)stream_min);
        }
        for (Py_ssize_t r = 0; r < nz; r++) {
            const int64_t *row = z + 2 * r;
            const Py_buffer *d = &dsts[row[0]];
            copy_span(d, NULL, axis, row[1], 0, d->shape[axis] - row[1], (size_t)stream_min);
        }
#ifdef ZS_STREAM
        _mm_sfence();
#endif
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&parts);
    PyBuffer_Release(&pads);
    release_all(dsts, nd);
    release_all(srcs, ns);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* narrow(dst, src): a float array of int16 samples (x / 32768) as those int16 samples,
 * for the RAM tier's decoded shards (half or a quarter of the bytes); True when every
 * value is exactly one, so that widening dst again (x * 2**-15) gives src bit for bit.
 * False when one is not (NaN, inf, -0.0, a fraction, or outside [-32768, 32767]
 * samples): dst is then unfinished.  One pass (SSE2 on x86-64); numpy needs three
 * (convert, convert back, compare). */
#define ZS_NARROW(NAME, T, U)                                                              \
    static int NAME(int16_t *d, const T *s, size_t n) {                                    \
        U bad = 0;                                                                         \
        for (size_t i = 0; i < n; i++) {                                                   \
            T v = s[i] * (T)32768;                                                         \
            int ok = v >= (T)-32768 && v <= (T)32767;                                      \
            int32_t q = (int32_t)(ok ? v : (T)0);                                          \
            T back = (T)q;                                                                 \
            U bv, bb;                                                                      \
            memcpy(&bv, &v, sizeof bv);                                                    \
            memcpy(&bb, &back, sizeof bb);                                                 \
            bad |= (bv ^ bb) | (U)!ok;                                                     \
            d[i] = (int16_t)q;                                                             \
        }                                                                                  \
        return bad == 0;                                                                   \
    }

ZS_NARROW(narrow_f32_tail, float, uint32_t)
ZS_NARROW(narrow_f64, double, uint64_t)

static int narrow_f32(int16_t *d, const float *s, size_t n) {
    size_t i = 0;
#ifdef ZS_STREAM
    const __m128 scale = _mm_set1_ps(32768.0f), lo = _mm_set1_ps(-32768.0f),
                 hi = _mm_set1_ps(32767.0f);
    __m128i bad = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128 a = _mm_mul_ps(_mm_loadu_ps(s + i), scale);
        __m128 b = _mm_mul_ps(_mm_loadu_ps(s + i + 4), scale);
        /* outside the range (NaN too: both compares false) */
        __m128 ok = _mm_and_ps(_mm_and_ps(_mm_cmpge_ps(a, lo), _mm_cmple_ps(a, hi)),
                               _mm_and_ps(_mm_cmpge_ps(b, lo), _mm_cmple_ps(b, hi)));
        __m128i qa = _mm_cvttps_epi32(a), qb = _mm_cvttps_epi32(b);
        /* not a whole sample, or -0.0: the bits differ once converted back */
        bad = _mm_or_si128(bad, _mm_xor_si128(_mm_castps_si128(_mm_cvtepi32_ps(qa)),
                                              _mm_castps_si128(a)));
        bad = _mm_or_si128(bad, _mm_xor_si128(_mm_castps_si128(_mm_cvtepi32_ps(qb)),
                                              _mm_castps_si128(b)));
        bad = _mm_or_si128(bad, _mm_andnot_si128(_mm_castps_si128(ok), _mm_set1_epi32(-1)));
        _mm_storeu_si128((__m128i *)(d + i), _mm_packs_epi32(qa, qb));
    }
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(bad, _mm_setzero_si128())) != 0xFFFF)
        return 0;
#endif
    return narrow_f32_tail(d + i, s + i, n - i);
}

static int narrow_rows(char *dst, const char *src, int ndim, const Py_ssize_t *shape,
                       const Py_ssize_t *ds, const Py_ssize_t *ss, int wide) {
    if (ndim <= 1) {
        size_t n = ndim ? (size_t)shape[0] : 1;
        return wide == 4 ? narrow_f32((int16_t *)dst, (const float *)src, n)
                         : narrow_f64((int16_t *)dst, (const double *)src, n);
    }
    for (Py_ssize_t k = 0; k < shape[0]; k++)
        if (!narrow_rows(dst + k * ds[0], src + k * ss[0], ndim - 1, shape + 1, ds + 1, ss + 1,
                         wide))
            return 0;
    return 1;
}

/* The buffers of narrow's or widen's dst and src (``name``): the same shape, the last
 * axis contiguous, one side int16 and the other float32 or float64 (``to_int16``: dst is
 * the int16 one).  0, or -1 with the error set and nothing held. */
static int sample_pair(PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst, Py_buffer *src,
                       int to_int16, const char *name) {
    if (PyObject_GetBuffer(dst_obj, dst, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(src_obj, src, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    const Py_buffer *narrow_side = to_int16 ? dst : src, *wide_side = to_int16 ? src : dst;
    const char *problem = NULL;
    if (!is_int16(narrow_side) || !is_float(wide_side))
        problem = to_int16 ? "float32 or float64 src into int16 dst only"
                           : "int16 src into float32 or float64 dst only";
    else if (dst->ndim > ZS_MAX_DIMS)
        problem = "dst and src have too many dimensions";
    else
        problem = pair_problem(dst, src);
    if (problem) {
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        PyErr_Format(PyExc_ValueError, "%s: %s", name, problem);
        return -1;
    }
    return 0;
}

static PyObject *narrow(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO:narrow", &dst_obj, &src_obj))
        return NULL;
    Py_buffer dst, src;
    if (sample_pair(dst_obj, src_obj, &dst, &src, 1, "narrow") < 0)
        return NULL;
    int exact = 1;
    if (!is_empty(&dst)) {
        Py_BEGIN_ALLOW_THREADS
        exact = narrow_rows((char *)dst.buf, (const char *)src.buf, dst.ndim, dst.shape,
                            dst.strides, src.strides, (int)src.itemsize);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyBool_FromLong(exact);
}

/* widen(dst, src, stream_min): int16 samples into the float32 or float64 values they
 * stand for (x * 2**-15, exact), rows of stream_min bytes of dst or more with
 * non-temporal stores (a batch slot read later): what narrow() kept in the RAM tier,
 * copied out of a window.  Half the bytes of a float copy are read. */
static void widen_f32(float *d, const int16_t *s, size_t n, int stream) {
    const float k = 1.0f / 32768.0f;
    size_t i = 0;
#ifdef ZS_STREAM
    const __m128 kv = _mm_set1_ps(k);
    if (stream)
        for (; i < n && ((uintptr_t)(d + i) & 15); i++)
            d[i] = (float)s[i] * k;
    for (; i + 8 <= n; i += 8) {
        __m128i x = _mm_loadu_si128((const __m128i *)(s + i));
        __m128 lo = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(x, x), 16)), kv);
        __m128 hi = _mm_mul_ps(_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpackhi_epi16(x, x), 16)), kv);
        if (stream) {
            _mm_stream_ps(d + i, lo);
            _mm_stream_ps(d + i + 4, hi);
        } else {
            _mm_storeu_ps(d + i, lo);
            _mm_storeu_ps(d + i + 4, hi);
        }
    }
#else
    (void)stream;
#endif
    for (; i < n; i++)
        d[i] = (float)s[i] * k;
}

static void widen_f64(double *d, const int16_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = (double)s[i] * (1.0 / 32768.0);
}

static void widen_rows(char *dst, const char *src, int ndim, const Py_ssize_t *shape,
                       const Py_ssize_t *ds, const Py_ssize_t *ss, int wide, size_t stream_min) {
    if (ndim <= 1) {
        size_t n = ndim ? (size_t)shape[0] : 1;
        if (wide == 4)
            widen_f32((float *)dst, (const int16_t *)src, n, 4 * n >= stream_min);
        else
            widen_f64((double *)dst, (const int16_t *)src, n);
        return;
    }
    for (Py_ssize_t k = 0; k < shape[0]; k++)
        widen_rows(dst + k * ds[0], src + k * ss[0], ndim - 1, shape + 1, ds + 1, ss + 1, wide,
                   stream_min);
}

static PyObject *widen(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t stream_min;
    if (!PyArg_ParseTuple(args, "OOn:widen", &dst_obj, &src_obj, &stream_min))
        return NULL;
    Py_buffer dst, src;
    if (sample_pair(dst_obj, src_obj, &dst, &src, 0, "widen") < 0)
        return NULL;
    if (!is_empty(&dst)) {
        Py_BEGIN_ALLOW_THREADS
        widen_rows((char *)dst.buf, (const char *)src.buf, dst.ndim, dst.shape, dst.strides,
                   src.strides, (int)dst.itemsize, (size_t)stream_min);
#ifdef ZS_STREAM
        _mm_sfence();
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
    {"gather", gather, METH_VARARGS,
     "gather(dsts, srcs, parts, pads, axis, stream_min): spans of srcs into dsts along "
     "axis, rows (dst, src, lo, n, at) of the int64 table parts; zeros from at to the end "
     "for rows (dst, at) of pads; rows of stream_min bytes or more streamed."},
    {"narrow", narrow, METH_VARARGS,
     "narrow(dst, src): float src (int16 samples x / 32768) into int16 dst as samples; "
     "True when every value is exactly one (else dst is unfinished)."},
    {"widen", widen, METH_VARARGS,
     "widen(dst, src, stream_min): int16 samples src into float dst (x * 2**-15, exact); "
     "rows of stream_min bytes or more streamed."},
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
