/* Every cut of every token of a vocabulary into two tokens of the same vocabulary: the merges of a SentencePiece
 * vocabulary that has none of its own (Gemma's GGUF), which tokenizer/splits.py otherwise finds with numpy.
 *
 * Why in C: Gemma 3's 262,144 pieces have ~1.2 million cuts; this is one pass over them with a hash table of the
 * pieces (tens of milliseconds), where numpy's whole-array rounds take ~0.7 s of every start, most of the tokenizer
 * build's own Python work.
 *
 * Exact: a lookup compares the code points themselves, so two pieces that share a hash are told apart. Where a string
 * is the vocabulary's twice, the first index stands for it (any index names the same string).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const uint32_t *codes;
    const int64_t *starts, *lengths;
    int64_t *slots; /* token index + 1, 0 for an empty slot */
    uint64_t mask;
} piece_table;

static uint64_t hash_codes(const uint32_t *p, int64_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    for (int64_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001B3ULL; /* FNV-1a over code points */
    return h ^ (h >> 29);
}

/* the slot holding the piece p[0, n), or the empty slot where it would go */
static int64_t *find_slot(const piece_table *t, const uint32_t *p, int64_t n) {
    for (uint64_t s = hash_codes(p, n) & t->mask;; s = (s + 1) & t->mask) {
        int64_t id = t->slots[s] - 1;
        if (id < 0) return &t->slots[s];
        if (t->lengths[id] == n && memcmp(t->codes + t->starts[id], p, (size_t)n * sizeof *p) == 0) return &t->slots[s];
    }
}

int64_t token_splits(const uint32_t *codes, const int64_t *starts, const int64_t *lengths, int64_t n, int64_t *left,
                     int64_t *right, int64_t capacity) {
    uint64_t size = 1;
    while (size < 2 * (uint64_t)n + 1) size <<= 1; /* at most half full */
    piece_table t = {codes, starts, lengths, calloc(size, sizeof(int64_t)), size - 1};
    if (t.slots == NULL) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t *slot = find_slot(&t, codes + starts[i], lengths[i]);
        if (*slot == 0) *slot = i + 1;
    }
    int64_t found = 0;
    for (int64_t i = 0; i < n && found >= 0; i++) {
        const uint32_t *p = codes + starts[i];
        for (int64_t cut = lengths[i] - 1; cut > 0; cut--) { /* the longer left piece first */
            int64_t a = *find_slot(&t, p, cut) - 1;
            if (a < 0) continue;
            int64_t b = *find_slot(&t, p + cut, lengths[i] - cut) - 1;
            if (b < 0) continue;
            if (found == capacity) {
                found = -2;
                break;
            }
            left[found] = a;
            right[found++] = b;
        }
    }
    free(t.slots);
    return found;
}
