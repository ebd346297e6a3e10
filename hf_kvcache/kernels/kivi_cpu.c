/* KIVI codes decoded on the CPU in one pass per token: unpack, dequantize, and for the int3 / int2 defaults rotate
 * back (Hadamard) and turn pre-RoPE keys to their positions, written straight into the float32 workspace that sdpa
 * reads. The pure-torch path makes ~15 passes over the history for the same result (hf_kvcache/formats/kivi.py and
 * rotated.py, which this must equal; tests/test_cpu_native.py). Built at first use by hf_kvcache/kernels/cpu_native.py
 * with the machine's C compiler; plain C11 plus GCC / Clang vector extensions, no Python or torch headers. */
#include <stdint.h>
#include <string.h>

/* Every byte's codes as floats, so unpacking is one small copy per byte (tables of 2, 4 and 8 KiB, in L1). LUT1 holds
 * the 3-bit layout's high plane already worth 4. */
static float LUT4[256][2], LUT2[256][4], LUT1[256][8];

void kivi_cpu_init(void) {
    for (int b = 0; b < 256; b++) {
        for (int i = 0; i < 2; i++) LUT4[b][i] = (float)((b >> (4 * i)) & 15);
        for (int i = 0; i < 4; i++) LUT2[b][i] = (float)((b >> (2 * i)) & 3);
        for (int i = 0; i < 8; i++) LUT1[b][i] = (float)(((b >> i) & 1) * 4);
    }
}

/* One token's D codes in pack()'s layout (hf_kvcache/quant.py): low bits first; 3 bits as a 2-bit plane (D / 4
 * bytes) then a 1-bit plane of the high bits (D / 8 bytes). */
static inline void unpack_row(const uint8_t *restrict c, float *restrict buf, int64_t D, int bits) {
    if (bits == 4) {
        for (int64_t j = 0; j < D / 2; j++) memcpy(buf + 2 * j, LUT4[c[j]], sizeof LUT4[0]);
    } else if (bits == 2) {
        for (int64_t j = 0; j < D / 4; j++) memcpy(buf + 4 * j, LUT2[c[j]], sizeof LUT2[0]);
    } else { /* 3 */
        for (int64_t j = 0; j < D / 4; j++) memcpy(buf + 4 * j, LUT2[c[j]], sizeof LUT2[0]);
        const uint8_t *hi = c + D / 4;
        for (int64_t m = 0; m < D / 8; m++) {
            const float *h = LUT1[hi[m]];
            for (int i = 0; i < 8; i++) buf[8 * m + i] += h[i];
        }
    }
}

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SWAP(a, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#else
#define SWAP(a, ...) __builtin_shuffle(a, (i8){__VA_ARGS__})
#endif

/* x H over D = 8n floats (n a power of two), Sylvester's order, unnormalized (the caller folds 1 / sqrt(D) into the
 * dequantization): the three butterfly stages inside an 8-lane vector as a lane swap and a signed add, the others
 * between vectors. */
static inline void hadamard(float *restrict x, int64_t D) {
    v8 v[128];
    int64_t n = D / 8;
    memcpy(v, x, D * sizeof(float));
    const v8 m1 = {1, -1, 1, -1, 1, -1, 1, -1}, m2 = {1, 1, -1, -1, 1, 1, -1, -1}, m4 = {1, 1, 1, 1, -1, -1, -1, -1};
    for (int64_t i = 0; i < n; i++) {
        v8 a = v[i];
        a = a * m1 + SWAP(a, 1, 0, 3, 2, 5, 4, 7, 6);
        a = a * m2 + SWAP(a, 2, 3, 0, 1, 6, 7, 4, 5);
        a = a * m4 + SWAP(a, 4, 5, 6, 7, 0, 1, 2, 3);
        v[i] = a;
    }
    for (int64_t len = 1; len < n; len <<= 1)
        for (int64_t i = 0; i < n; i += 2 * len)
            for (int64_t j = i; j < i + len; j++) {
                v8 a = v[j], b = v[j + len];
                v[j] = a + b;
                v[j + len] = a - b;
            }
    memcpy(x, v, D * sizeof(float));
}

/* Tokens [r0, r1) of the (B, H, T) tokens (flattened b, h, t) of one stored tensor, decoded into out (B, H, T, D).
 * Strides in elements, [b, h, row] (the last dimension of every tensor is contiguous); a scale / zero row is a token
 * (per_token: D / G groups of G channels) or a key group of G tokens (D channels). gain multiplies the dequantized
 * value (1 / sqrt(D) before an unnormalized Hadamard transform). angles: NULL, or the (first + T, 2, D / 2) table of
 * cos then sin per position of keys stored before RoPE, turned as rotate_half pairs (i, i + D / 2). */
void kivi_decode_f32(const uint8_t *codes, const int64_t *cs, const float *scale, const int64_t *ss,
                     const float *zero, const int64_t *zs, float *out, const int64_t *os, int64_t H, int64_t T,
                     int64_t D, int bits, int64_t G, int per_token, float gain, int rotate, const float *angles,
                     int64_t first, int64_t r0, int64_t r1) {
    float buf[1024] __attribute__((aligned(32)));
    float sg[1024], zg[1024];
    const int64_t half = D / 2;
    for (int64_t bh = r0 / T; bh * T < r1; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const uint8_t *cb = codes + b * cs[0] + h * cs[1];
        const float *sb = scale + b * ss[0] + h * ss[1], *zb = zero + b * zs[0] + h * zs[1];
        float *ob = out + b * os[0] + h * os[1];
        const int64_t t0 = r0 > bh * T ? r0 - bh * T : 0, t1 = r1 < (bh + 1) * T ? r1 - bh * T : T;
        for (int64_t t = t0; t < t1; t++) {
            unpack_row(cb + t * cs[2], buf, D, bits);
            if (per_token) {
                const float *s = sb + t * ss[2], *z = zb + t * zs[2];
                for (int64_t g = 0; g < D / G; g++) {
                    const float sv = s[g] * gain, zv = z[g] * gain;
                    for (int64_t j = g * G; j < (g + 1) * G; j++) buf[j] = buf[j] * sv + zv;
                }
            } else {
                if (t == t0 || t % G == 0) {
                    const float *s = sb + (t / G) * ss[2], *z = zb + (t / G) * zs[2];
                    for (int64_t d = 0; d < D; d++) {
                        sg[d] = s[d] * gain;
                        zg[d] = z[d] * gain;
                    }
                }
                for (int64_t d = 0; d < D; d++) buf[d] = buf[d] * sg[d] + zg[d];
            }
            if (rotate) hadamard(buf, D);
            float *restrict o = ob + t * os[2];
            if (angles) {
                const float *cosv = angles + (first + t) * D, *sinv = cosv + half;
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = buf[i], x2 = buf[i + half];
                    o[i] = x1 * cosv[i] - x2 * sinv[i];
                    o[i + half] = x2 * cosv[i] + x1 * sinv[i];
                }
            } else {
                memcpy(o, buf, D * sizeof(float));
            }
        }
    }
}
