/* A key as a fixed-size value: 16 bytes inline and a tag, so that the index holds no pointers
 * for the keys engines give (16-byte digests, and the 17-byte negative-int form of keys.py).
 *
 * A key of 1..16 bytes is kept zero-padded with its length as the tag (b"\x01" and b"\x01\x00"
 * stay apart); b"-" + 16 bytes is the tag IX_TAG_NEG and its 16 bytes; any other length
 * (a 32-byte sha256 of vLLM's hash option, a key with a group suffix) is IX_TAG_LONG with a
 * 128-bit digest inline, and the index compares the whole bytes again on a digest match, so two
 * keys are equal exactly when their bytes are.
 */
#include <string.h>

#include "ix.h"

#define MUL1 0xff51afd7ed558ccdULL /* murmur3's finalizer constants */
#define MUL2 0xc4ceb9fe1a85ec53ULL
#define GOLD 0x9e3779b97f4a7c15ULL
#define SEED_B 0x2545f4914f6cdd1dULL

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= MUL1;
    x ^= x >> 33;
    x *= MUL2;
    x ^= x >> 33;
    return x;
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

uint64_t ix_key_hash(const uint8_t b[IX_KEY_BYTES], uint8_t tag) {
    return mix64(load64(b) ^ mix64(load64(b + 8) + GOLD * (uint64_t)(tag + 1)));
}

/* Two 64-bit lanes over 8-byte words; a collision only costs a comparison of the bytes (the
 * index keeps them) or, for an ARC ghost, a misjudged recency. */
static void digest(const uint8_t *p, size_t n, uint8_t out[IX_KEY_BYTES]) {
    uint64_t a = GOLD ^ n, b = SEED_B + n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = load64(p + i);
        a = mix64(a ^ w) + b;
        b = mix64(b + w * GOLD) ^ a;
    }
    if (i < n) {
        uint8_t tail[8] = {0};
        memcpy(tail, p + i, n - i);
        uint64_t w = load64(tail);
        a = mix64(a ^ w) + b;
        b = mix64(b + w * GOLD) ^ a;
    }
    a = mix64(a ^ (b >> 1));
    b = mix64(b ^ a);
    memcpy(out, &a, 8);
    memcpy(out + 8, &b, 8);
}

void ix_key_none(ix_key *k) {
    memset(k, 0, sizeof *k);
    k->tag = IX_TAG_NONE;
    k->hash = ix_key_hash(k->b, k->tag);
}

void ix_key_set(ix_key *k, const uint8_t *p, size_t n) {
    memset(k->b, 0, IX_KEY_BYTES);
    k->full = NULL;
    k->len = n;
    if (n == 0) {
        ix_key_none(k);
        return;
    }
    if (n <= IX_KEY_BYTES) {
        memcpy(k->b, p, n);
        k->tag = (uint8_t)n;
    } else if (n == IX_KEY_BYTES + 1 && p[0] == '-') {
        memcpy(k->b, p + 1, IX_KEY_BYTES);
        k->tag = IX_TAG_NEG;
    } else {
        digest(p, n, k->b);
        k->tag = IX_TAG_LONG;
        k->full = p;
    }
    k->hash = ix_key_hash(k->b, k->tag);
}

size_t ix_key_bytes(const uint8_t b[IX_KEY_BYTES], uint8_t tag, uint8_t *out) {
    if (tag == IX_TAG_NEG) {
        out[0] = '-';
        memcpy(out + 1, b, IX_KEY_BYTES);
        return IX_KEY_BYTES + 1;
    }
    if (tag >= 1 && tag <= IX_KEY_BYTES) {
        memcpy(out, b, tag);
        return tag;
    }
    return 0; /* long keys: their bytes are kept beside the entry */
}
