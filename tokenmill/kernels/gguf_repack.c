/* A GGUF file's quantised blocks regrouped once at load into the GGUF kernels' own layout (gguf_packed.h draws it):
 * sixteen columns side by side in each code vector, so that one integer dot product serves sixteen output columns.
 * Plain C and AVX2 shuffles, per group of 16 columns; the groups handed out among the threads. */
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_SIMD)
/* bytes of one block of the file */
static inline int64_t block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q5_0: return 22;
        case Q8_0:
        case HIGH6: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        default: return 210; /* Q6_K */
    }
}

static int64_t row_bytes_of(int type, int64_t k) {
    switch (type) {
        case Q4_0: return k / 32 * 18;
        case Q5_0: return k / 32 * 22;
        case Q8_0:
        case HIGH6: return k / 32 * 34;
        case Q4_K: return k % 256 ? -1 : k / 256 * 144;
        case Q5_K: return k % 256 ? -1 : k / 256 * 176;
        case Q6_K: return k % 256 ? -1 : k / 256 * 210;
        default: return -1;
    }
}

/* Q4_0's or Q5_0's 32 codes, unsigned with the type's offset: elements 0-15 from the low nibbles of qs, 16-31 from
 * the high ones; Q5_0's fifth bits (bit e of the 32-bit qh for element e) as 16. Vectorised: the regrouping is part
 * of every start, and Q5_0 is most of a Gemma 3 file's weights. */
static inline __m256i q4_q5_codes(const uint8_t *qs, const uint8_t *qh) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    if (qh == NULL) return codes;
    uint32_t bits;
    memcpy(&bits, qh, 4);
    /* byte e of each 128-bit lane gets byte e / 8 of its lane's quarter of qh (elements 0-15: bytes 0-1, 16-31:
     * 2-3), then is all ones where its bit e % 8 is set */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                            3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit), bit);
    return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

/* The 32 codes of sub-block j of a file block, unsigned with the type's offset (Q8_0: signed, as bytes). One switch
 * per sub-block, not per element: the regrouping is part of every start. */
static void file_codes(int type, const uint8_t *blk, int j, uint8_t *codes) {
    switch (type) {
        case Q4_0:
        case Q5_0:
            _mm256_storeu_si256((__m256i *)codes, q4_q5_codes(blk + (type == Q5_0 ? 6 : 2), type == Q5_0 ? blk + 2 : NULL));
            return;
        case Q8_0: memcpy(codes, blk + 2, 32); return;
        case HIGH6: /* floor(code / 4) + 32: Q6_K's unsigned range */
            for (int e = 0; e < 32; e++) codes[e] = (uint8_t)(((int8_t)blk[2 + e] >> 2) + 32);
            return;
        case Q4_K:
        case Q5_K: {
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
            for (int e = 0; e < 32; e++) {
                int lo = j & 1 ? qs[e] >> 4 : qs[e] & 0x0f;
                codes[e] = (uint8_t)(type == Q5_K ? lo | ((blk[16 + e] >> j) & 1) << 4 : lo);
            }
            return;
        }
        default: { /* Q6_K */
            int h = j / 4, q = j % 4;
            const uint8_t *ql = blk + 64 * h + 32 * (q % 2), *qh = blk + 128 + 32 * h;
            for (int e = 0; e < 32; e++)
                codes[e] = (uint8_t)((q < 2 ? ql[e] & 0x0f : ql[e] >> 4) | ((qh[e] >> (2 * q)) & 3) << 4);
            return;
        }
    }
}

/* one sub-block's codes for 16 columns (cols[c]: column c's file block) in the layout above */
static void repack_codes(int type, const uint8_t *const cols[GROUP], int j, uint8_t *out) {
    uint8_t codes[GROUP][32], vec[8][64];
    for (int c = 0; c < GROUP; c++) file_codes(type, cols[c], j, codes[c]);
    for (int g = 0; g < 8; g++)
        for (int c = 0; c < GROUP; c++) memcpy(&vec[g][4 * c], &codes[c][4 * g], 4);
    if (type == Q8_0) {
        memcpy(out, vec, 512);
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 64; i += 32) {
            __m256i a = _mm256_and_si256(load32(&vec[p][i]), low), b = _mm256_and_si256(load32(&vec[p + 4][i]), low);
            _mm256_storeu_si256((__m256i *)(out + 64 * p + i), _mm256_or_si256(a, _mm256_slli_epi16(b, 4)));
        }
    if (type == Q5_0 || type == Q5_K)
        for (int i = 0; i < 64; i += 32) { /* bit 4 of vector g's bytes as bit g of the plane's */
            __m256i b = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(load32(&vec[g][i]), 4), _mm256_set1_epi8(1));
                b = _mm256_or_si256(b, _mm256_slli_epi16(fifth, g));
            }
            _mm256_storeu_si256((__m256i *)(out + 256 + i), b);
        }
    if (type == Q6_K || type == HIGH6)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 64; i += 32) { /* bits 4-5 of vectors 4h..4h+3, two bits each */
                __m256i b = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    __m256i shifted = _mm256_srli_epi16(load32(&vec[4 * h + v][i]), 4);
                    __m256i two = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                    b = _mm256_or_si256(b, _mm256_slli_epi16(two, 2 * v));
                }
                _mm256_storeu_si256((__m256i *)(out + 256 + 64 * h + i), b);
            }
}

static void repack_unit(int type, const uint8_t *const cols[GROUP], uint8_t *out) {
    uint8_t *p = out;
    for (int c = 0; c < GROUP; c++) memcpy(p + 2 * c, cols[c] + (type == Q6_K ? 208 : 0), 2); /* d */
    p += 32;
    if (type == Q4_K || type == Q5_K) {
        for (int c = 0; c < GROUP; c++) memcpy(p + 2 * c, cols[c] + 2, 2); /* dmin */
        p += 32;
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < GROUP; c++) k_scale_min(cols[c] + 4, j, p + 16 * j + c, p + 128 + 16 * j + c);
        p += 256;
    } else if (type == Q6_K) {
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < GROUP; c++) {
                const uint8_t *sc = cols[c] + 192 + 8 * (j / 4) + 2 * (j % 4);
                p[16 * j + c] = sc[0];
                p[128 + 16 * j + c] = sc[1];
            }
        p += 256;
    }
    for (int j = 0; j < (is_k(type) ? 8 : 1); j++) repack_codes(type, cols, j, p + j * code_bytes(type));
}

int64_t gguf_packed_bytes(int type, int64_t n, int64_t k) {
    if (packed_unit_bytes(type) < 0 || row_bytes_of(type, k) < 0) return -1;
    return (n + GROUP - 1) / GROUP * (k / (is_k(type) ? 256 : 32)) * packed_unit_bytes(type);
}

int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    int64_t unit = packed_unit_bytes(type), row_bytes = row_bytes_of(type, k);
    if (unit < 0 || row_bytes < 0) return -1;
    int64_t units = k / (is_k(type) ? 256 : 32);
    static const uint8_t zeros[256] = {0};
    /* groups handed out a few at a time, not in even shares: at load a tokenizer may be built on one of the cores */
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int64_t grp = 0; grp < (n + GROUP - 1) / GROUP; grp++)
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *cols[GROUP];
            for (int c = 0; c < GROUP; c++) {
                int64_t col = GROUP * grp + c;
                cols[c] = col < n ? w + col * row_bytes + u * block_bytes(type) : zeros;
            }
            repack_unit(type, cols, out + (grp * units + u) * unit);
        }
    return 0;
}
#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int64_t gguf_packed_bytes(int type, int64_t n, int64_t k) {
    (void)type, (void)n, (void)k;
    return -1;
}
int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    (void)type, (void)w, (void)n, (void)k, (void)out, (void)threads;
    return -1;
}
#endif

/* gguf_repack for `count` tensors in one call: a loader holds no GIL from the first to the last, so a tokenizer built
 * on another Python thread meanwhile (which holds the GIL through its long native calls) cannot stall it between
 * tensors. Job i regroups ws[i] (ns[i] rows of ks[i] weights of types[i]) into outs[i]. Where release[i] is not 0,
 * ws[i] lies in a private, never-written mapping of a file and its release[i] bytes are dropped from the process as
 * soon as they are read (madvise DONTNEED: the page cache keeps them, and a page shared with a neighbour faults back in
 * from the file), so the file's copy and the regrouped one are never both resident. */
int gguf_repack_all(int64_t count, const int *types, const uint8_t *const *ws, const int64_t *ns, const int64_t *ks,
                    uint8_t *const *outs, const int64_t *release, int threads) {
    for (int64_t i = 0; i < count; i++) {
        if (gguf_repack(types[i], ws[i], ns[i], ks[i], outs[i], threads)) return -1;
#if defined(__linux__)
        if (release[i] > 0) {
            uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), begin = (uintptr_t)ws[i] / page * page;
            madvise((void *)begin, (uintptr_t)ws[i] + (uintptr_t)release[i] - begin, MADV_DONTNEED);
        }
#else
        (void)release;
#endif
    }
    return 0;
}
