/* KIVI codes on the CPU, one pass per token each way.
 *
 * Decode: unpack, dequantize, and for the int3 / int2 defaults rotate back (Hadamard) and turn pre-RoPE keys to their
 * positions, written straight into the float32 workspace that sdpa reads. The pure-torch path makes ~15 passes over
 * the history for the same result (hf_kvcache/formats/kivi.py and rotated.py, which this must equal to float32
 * rounding; tests/test_cpu_native.py).
 *
 * Encode: a group's minimum and maximum, its scale and zero point, codes and packing, bit for bit as
 * quantize_asymmetric() and pack() in hf_kvcache/quant.py compute them for float32 scales (the same IEEE operations
 * in the same order: divisions and subtractions only, so no contraction into fused multiply-adds can change a bit);
 * int8's symmetric codes (quantize_symmetric()) the same way; Hadamard-rotated int8 codes decoded and rotated back.
 *
 * Built at first use by hf_kvcache/kernels/cpu_native.py with the machine's C compiler; plain C11 plus GCC / Clang
 * vector extensions, no Python, torch or libm. */
#include <stdint.h>
#include <string.h>

#define MAX_D 1024 /* widest head served (cpu_native.MAX_WIDTH) */

/* Vectors of VL float lanes: 16 (one register) where the compiler targets AVX-512, else 8 (AVX2's register, or two
 * of SSE's). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
#if defined(__AVX512F__)
#define VL 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#else
#define VL 8
typedef v8 vf;
typedef i8 vi;
#endif
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
#if defined(__clang__)
#define SWAP(a, ...) __builtin_shufflevector(a, a, __VA_ARGS__)
#else
#define SWAP(a, ...) __builtin_shuffle(a, (vi){__VA_ARGS__})
#endif

/* v (n vectors, D = n VL floats, n a power of two) times H, Sylvester's order, unnormalized (the caller folds
 * 1 / sqrt(D) into the dequantization): the butterfly stages inside a vector as a lane swap and a signed add, the
 * others between vectors. Inlined with n known, the loops unroll into registers. */
static inline __attribute__((always_inline)) void hadamard_regs(vf *v, const int64_t n) {
#if VL == 16
    const vf m1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1},
             m2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1},
             m4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1},
             m8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
#else
    const vf m1 = {1, -1, 1, -1, 1, -1, 1, -1}, m2 = {1, 1, -1, -1, 1, 1, -1, -1}, m4 = {1, 1, 1, 1, -1, -1, -1, -1};
#endif
    for (int64_t i = 0; i < n; i++) {
        vf a = v[i];
#if VL == 16
        a = a * m1 + SWAP(a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
        a = a * m2 + SWAP(a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
        a = a * m4 + SWAP(a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
        a = a * m8 + SWAP(a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#else
        a = a * m1 + SWAP(a, 1, 0, 3, 2, 5, 4, 7, 6);
        a = a * m2 + SWAP(a, 2, 3, 0, 1, 6, 7, 4, 5);
        a = a * m4 + SWAP(a, 4, 5, 6, 7, 0, 1, 2, 3);
#endif
        v[i] = a;
    }
    for (int64_t len = 1; len < n; len <<= 1)
        for (int64_t i = 0; i < n; i += 2 * len)
            for (int64_t j = i; j < i + len; j++) {
                const vf a = v[j], b = v[j + len];
                v[j] = a + b;
                v[j + len] = a - b;
            }
}

/* The same stages in the same order, one float at a time: the generic path's transform where D is not a multiple of
 * VL (D = 8 under AVX-512). */
static void hadamard_scalar(float *restrict x, int64_t D) {
    for (int64_t len = 1; len < D; len <<= 1)
        for (int64_t i = 0; i < D; i += 2 * len)
            for (int64_t j = i; j < i + len; j++) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
}

/* x (64-byte aligned) times H over its D floats. */
static void hadamard(float *restrict x, int64_t D) {
    if (D % VL) {
        hadamard_scalar(x, D);
        return;
    }
    switch (D / VL) {
    case 4: hadamard_regs((vf *)x, 4); break;
    case 8: hadamard_regs((vf *)x, 8); break;
    default: hadamard_regs((vf *)x, D / VL);
    }
}

/* Every byte's codes as floats, so unpacking is one small copy per byte (tables of 2, 4 and 8 KiB, in L1). LUT1 holds
 * the 3-bit layout's high plane already worth 4. */
static float LUT4[256][2], LUT2[256][4], LUT1[256][8] __attribute__((aligned(32)));

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
        v8 *out = (v8 *)buf; /* 32-byte aligned, as is every row of LUT1 */
        for (int64_t m = 0; m < D / 8; m++) out[m] += *(const v8 *)LUT1[hi[m]];
    }
}

/* Tokens [r0, r1) of the (B, H, T) tokens (flattened b, h, t) of one stored tensor, decoded into out (B, H, T, D).
 * Strides in elements, [b, h, row] for codes, scale, zero and out in that order (the last dimension of every tensor
 * is contiguous); a scale / zero row is a token (per_token: D / G groups of G channels) or a key group of G tokens
 * (D channels). gain multiplies the dequantized value (1 / sqrt(D) before an unnormalized Hadamard transform).
 * angles: NULL, or the (first + T, 2, D / 2) table of cos then sin per position of keys stored before RoPE, turned as
 * rotate_half pairs (i, i + D / 2). */
static void decode_generic(const uint8_t *codes, const float *scale, const float *zero, float *out,
                           const int64_t *st, int64_t H, int64_t T, int64_t D, int bits, int64_t G, int per_token,
                           float gain, int rotate, const float *angles, int64_t first, int64_t r0, int64_t r1) {
    const int64_t *cs = st, *ss = st + 3, *zs = st + 6, *os = st + 9;
    float buf[MAX_D] __attribute__((aligned(64)));
    float sg[MAX_D], zg[MAX_D];
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

/* The same decode with a token held in VL-lane registers from its codes to its store: each vector's codes are
 * shifted out of one or two little-endian words, converted, dequantized, rotated and turned without a trip through
 * memory (the generic path writes the token to a buffer between steps, and wide loads of narrower stores stall).
 * Taken where every vector lies in one scale group and the RoPE halves are whole vectors: D a multiple of 2 VL and,
 * per token, G a multiple of VL. */

static inline uint32_t load_bytes(const uint8_t *p, int n) {
    uint32_t w = 0;
    memcpy(&w, p, n); /* little-endian: the first byte lowest, as pack() orders codes */
    return w;
}

/* Codes k VL .. k VL + VL - 1 of a token, as floats. */
static inline __attribute__((always_inline)) vf codes_vec(const uint8_t *restrict c, int64_t D, int bits, int64_t k) {
#if VL == 16
    const vu lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vu lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
    vu x;
    if (bits == 4) {
#if VL == 16
        const vu first = (vu)(lane < 8); /* lanes 0-7 read the first word, 8-15 the second */
        const vu src = (first & load_bytes(c + 8 * k, 4)) | (~first & load_bytes(c + 8 * k + 4, 4));
        x = (src >> ((lane & 7) * 4)) & 15;
#else
        x = ((vu){0} + load_bytes(c + 4 * k, 4)) >> (lane * 4) & 15;
#endif
    } else {
        x = ((vu){0} + load_bytes(c + k * VL / 4, VL / 4)) >> (lane * 2) & 3;
        if (bits == 3) x |= (((vu){0} + load_bytes(c + D / 4 + k * VL / 8, VL / 8)) >> lane & 1) << 2;
    }
    return __builtin_convertvector((vi)x, vf);
}

static inline vf load_vec(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* decode_generic's contract, n = D / VL vectors a token (a constant where inlined for the common widths). */
static inline __attribute__((always_inline)) void decode_regs(
    const uint8_t *codes, const float *scale, const float *zero, float *out, const int64_t *st, int64_t H, int64_t T,
    int bits, int64_t G, int per_token, float gain, int rotate, const float *angles, int64_t first, int64_t r0,
    int64_t r1, const int64_t n) {
    const int64_t *cs = st, *ss = st + 3, *zs = st + 6, *os = st + 9, D = n * VL, half = n / 2;
    vf sg[MAX_D / VL] = {0}, zg[MAX_D / VL] = {0}, v[MAX_D / VL];
    for (int64_t bh = r0 / T; bh * T < r1; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const uint8_t *cb = codes + b * cs[0] + h * cs[1];
        const float *sb = scale + b * ss[0] + h * ss[1], *zb = zero + b * zs[0] + h * zs[1];
        float *ob = out + b * os[0] + h * os[1];
        const int64_t t0 = r0 > bh * T ? r0 - bh * T : 0, t1 = r1 < (bh + 1) * T ? r1 - bh * T : T;
        for (int64_t t = t0; t < t1; t++) {
            const uint8_t *c = cb + t * cs[2];
            if (per_token) {
                const float *s = sb + t * ss[2], *z = zb + t * zs[2];
                for (int64_t k = 0; k < n; k++) {
                    const int64_t g = k * VL / G;
                    v[k] = codes_vec(c, D, bits, k) * (s[g] * gain) + z[g] * gain;
                }
            } else {
                if (t == t0 || t % G == 0) {
                    const float *s = sb + (t / G) * ss[2], *z = zb + (t / G) * zs[2];
                    for (int64_t k = 0; k < n; k++) {
                        sg[k] = load_vec(s + k * VL) * gain;
                        zg[k] = load_vec(z + k * VL) * gain;
                    }
                }
                for (int64_t k = 0; k < n; k++) v[k] = codes_vec(c, D, bits, k) * sg[k] + zg[k];
            }
            if (rotate) hadamard_regs(v, n);
            float *o = ob + t * os[2];
            if (angles) {
                const float *cosv = angles + (first + t) * D, *sinv = cosv + D / 2;
                for (int64_t k = 0; k < half; k++) {
                    const vf x1 = v[k], x2 = v[k + half], cv = load_vec(cosv + k * VL), sv = load_vec(sinv + k * VL);
                    v[k] = x1 * cv - x2 * sv;
                    v[k + half] = x2 * cv + x1 * sv;
                }
            }
            memcpy(o, v, D * sizeof(float));
        }
    }
}

/* Tokens [r0, r1) of the (B, H, T) tokens of one stored tensor decoded into out: see decode_generic. */
void kivi_decode_f32(const uint8_t *codes, const float *scale, const float *zero, float *out, const int64_t *st,
                     int64_t H, int64_t T, int64_t D, int bits, int64_t G, int per_token, float gain, int rotate,
                     const float *angles, int64_t first, int64_t r0, int64_t r1) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (D % (2 * VL) == 0 && (!per_token || G % VL == 0)) {
#define REGS(n) \
    decode_regs(codes, scale, zero, out, st, H, T, bits, G, per_token, gain, rotate, angles, first, r0, r1, n)
        switch (D / VL) {
        case 2: REGS(2); return;
        case 4: REGS(4); return;
        case 8: REGS(8); return;
        case 16: REGS(16); return;
        default: REGS(D / VL); return;
        }
#undef REGS
    }
#endif
    decode_generic(codes, scale, zero, out, st, H, T, D, bits, G, per_token, gain, rotate, angles, first, r0, r1);
}

/* torch.round (half to even) of p in [-2^22, 2^22] under the default rounding mode: adding 1.5 * 2^23 leaves no
 * fraction bits, so the sum is rounded to an integer the IEEE way, and subtracting is exact. */
static inline float round_even(float p) {
    const float magic = 12582912.0f;
    return (p + magic) - magic;
}

/* The smallest float32 above s > 0, saturating at the largest finite value (quant._cover's nextafter then
 * _saturate). */
static inline float step_up(float s) {
    uint32_t u;
    memcpy(&u, &s, 4);
    if (u >= 0x7f7fffffu) return s;
    u++;
    memcpy(&s, &u, 4);
    return s;
}

/* quantize_asymmetric's scale for a group of finite values between mn and mx (zero point = mn for float32). */
static inline float group_scale(float mn, float mx, float top) {
    float scale = mx / top - mn / top;
    if (mx - mn > 0 && scale == 0) scale = 1.401298464324817e-45f; /* _nonzero_scale: smallest positive */
    const float positive = scale > 0 ? scale : 1.0f;
    if (mx / positive - mn / positive > top) scale = step_up(scale); /* _cover */
    return scale;
}

static inline uint8_t code_of(float x, float scale, float zero, float top) {
    const float safe = scale > 0 ? scale : 1.0f;
    float p = x / safe - zero / safe;
    p = p < -1.0f ? -1.0f : (p > top + 1.0f ? top + 1.0f : p); /* rounding then clamping to [0, top] is unchanged */
    p = round_even(p);
    return (uint8_t)(p < 0.0f ? 0.0f : (p > top ? top : p));
}

/* pack() of one token's D codes: low bits first; 3 bits as the 2-bit plane of (c & 3) then the 1-bit plane of c >> 2. */
static inline void pack_row(const uint8_t *restrict c, uint8_t *restrict out, int64_t D, int bits) {
    if (bits == 4) {
        for (int64_t j = 0; j < D / 2; j++) out[j] = (uint8_t)(c[2 * j] | c[2 * j + 1] << 4);
    } else {
        for (int64_t j = 0; j < D / 4; j++)
            out[j] = (uint8_t)((c[4 * j] & 3) | (c[4 * j + 1] & 3) << 2 | (c[4 * j + 2] & 3) << 4 | (c[4 * j + 3] & 3) << 6);
        if (bits == 3) {
            uint8_t *hi = out + D / 4;
            for (int64_t m = 0; m < D / 8; m++) {
                uint8_t byte = 0;
                for (int i = 0; i < 8; i++) byte |= (uint8_t)((c[8 * m + i] >> 2) << i);
                hi[m] = byte;
            }
        }
    }
}

/* Whether every one of n floats is finite (its exponent bits not all ones), in integer operations that vectorize. */
static inline int all_finite(const float *restrict x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

/* KIVI-encode rows [r0, r1) of x (B, H, T, D) float32 into packed codes (B, H, T, D * bits / 8) and float32 scale /
 * zero rows. per_token: a row is a token, groups of G channels, scale / zero (B, H, T, D / G). Otherwise a row is a
 * key group of G tokens, each channel its own group over them, scale / zero (B, H, T / G, D). Strides in elements,
 * [b, h, row] for x, codes, scale, zero in that order (last dimensions contiguous). Returns 0, or 1 where a value is
 * not finite (what was written is then undefined: the caller encodes those tensors in torch, which masks them). */
int kivi_encode_f32(const float *x, uint8_t *codes, float *scale, float *zero, const int64_t *st, int64_t H,
                    int64_t T, int64_t D, int bits, int64_t G, int per_token, int64_t r0, int64_t r1) {
    const float top = (float)((1 << bits) - 1);
    const int64_t rows_per_head = per_token ? T : T / G;
    uint8_t c[MAX_D];
    float mn[MAX_D], mx[MAX_D], sc[MAX_D];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t bh = r / rows_per_head, row = r % rows_per_head, b = bh / H, h = bh % H;
        const float *xb = x + b * st[0] + h * st[1];
        uint8_t *cb = codes + b * st[3] + h * st[4];
        float *s = scale + b * st[6] + h * st[7] + row * st[8], *z = zero + b * st[9] + h * st[10] + row * st[11];
        if (per_token) {
            const float *xt = xb + row * st[2];
            if (!all_finite(xt, D)) return 1;
            for (int64_t g = 0; g < D / G; g++) {
                float lo = xt[g * G], hi = lo;
                for (int64_t j = g * G + 1; j < (g + 1) * G; j++) {
                    lo = xt[j] < lo ? xt[j] : lo;
                    hi = xt[j] > hi ? xt[j] : hi;
                }
                const float sv = group_scale(lo, hi, top);
                s[g] = sv;
                z[g] = lo;
                for (int64_t j = g * G; j < (g + 1) * G; j++) c[j] = code_of(xt[j], sv, lo, top);
            }
            pack_row(c, cb + row * st[5], D, bits);
        } else {
            const float *xg = xb + row * G * st[2];
            for (int64_t t = 0; t < G; t++)
                if (!all_finite(xg + t * st[2], D)) return 1;
            memcpy(mn, xg, D * sizeof(float));
            memcpy(mx, xg, D * sizeof(float));
            for (int64_t t = 1; t < G; t++) {
                const float *xt = xg + t * st[2];
                for (int64_t d = 0; d < D; d++) {
                    mn[d] = xt[d] < mn[d] ? xt[d] : mn[d];
                    mx[d] = xt[d] > mx[d] ? xt[d] : mx[d];
                }
            }
            for (int64_t d = 0; d < D; d++) {
                sc[d] = group_scale(mn[d], mx[d], top);
                s[d] = sc[d];
                z[d] = mn[d];
            }
            for (int64_t t = 0; t < G; t++) {
                const float *xt = xg + t * st[2];
                for (int64_t d = 0; d < D; d++) c[d] = code_of(xt[d], sc[d], mn[d], top);
                pack_row(c, cb + (row * G + t) * st[5], D, bits);
            }
        }
    }
    return 0;
}

/* quantize_symmetric() (hf_kvcache/quant.py) of rows [r0, r1) of x (B, H, T, D) float32, groups of G channels a token:
 * int8 codes (B, H, T, D) in [-127, 127] and float32 scales (B, H, T, D / G), the same operations in the same order,
 * bit for bit. Strides as kivi_encode_f32's, for x, codes and scale. Returns 0, or 1 where a value is not finite. */
int int8_encode_f32(const float *x, int8_t *codes, float *scale, const int64_t *st, int64_t H, int64_t T, int64_t D,
                    int64_t G, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const int64_t bh = r / T, t = r % T, b = bh / H, h = bh % H;
        const float *xt = x + b * st[0] + h * st[1] + t * st[2];
        int8_t *c = codes + b * st[3] + h * st[4] + t * st[5];
        float *s = scale + b * st[6] + h * st[7] + t * st[8];
        if (!all_finite(xt, D)) return 1;
        for (int64_t g = 0; g < D / G; g++) {
            float absmax = 0.0f;
            for (int64_t j = g * G; j < (g + 1) * G; j++) {
                const float a = xt[j] < 0 ? -xt[j] : xt[j];
                absmax = a > absmax ? a : absmax;
            }
            float sv = absmax / 127.0f;
            if (absmax > 0 && sv == 0) sv = 1.401298464324817e-45f; /* _nonzero_scale */
            if (absmax / (sv > 0 ? sv : 1.0f) > 127.0f) sv = step_up(sv); /* _cover */
            s[g] = sv;
            const float safe = sv > 0 ? sv : 1.0f;
            for (int64_t j = g * G; j < (g + 1) * G; j++) {
                float p = xt[j] / safe;
                p = p < -128.0f ? -128.0f : (p > 128.0f ? 128.0f : p);
                p = round_even(p);
                c[j] = (int8_t)(p < -127.0f ? -127.0f : (p > 127.0f ? 127.0f : p));
            }
        }
    }
    return 0;
}

/* RotatedCodec.decode() of Int8Codec's codes: rows [r0, r1) of int8 codes (B, H, T, D) times their float32 scales
 * (B, H, T, D / G), rotated back by the Hadamard transform of the head (D a power of two) into float32 out (B, H, T,
 * D), gain = 1 / sqrt(D) folded into the scales before the unnormalized transform, as KIVI's decode does: equal to
 * Int8Codec.decode() then rotate_back() to float32 rounding, in one pass (torch takes ~6, 2.5x longer for an int8
 * residual's 64-191 tokens at head_dim 64). Unrotated codes are left to torch, whose two vectorized passes are
 * faster than this loop. Strides: codes, scale, out. */
void int8_decode_rotated_f32(const int8_t *codes, const float *scale, float *out, const int64_t *st, int64_t H,
                             int64_t T, int64_t D, int64_t G, float gain, int64_t r0, int64_t r1) {
    float buf[MAX_D] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r++) {
        const int64_t bh = r / T, t = r % T, b = bh / H, h = bh % H;
        const int8_t *c = codes + b * st[0] + h * st[1] + t * st[2];
        const float *s = scale + b * st[3] + h * st[4] + t * st[5];
        for (int64_t g = 0; g < D / G; g++) {
            const float sv = s[g] * gain;
            for (int64_t j = g * G; j < (g + 1) * G; j++) buf[j] = (float)c[j] * sv;
        }
        hadamard(buf, D);
        memcpy(out + b * st[6] + h * st[7] + t * st[8], buf, D * sizeof(float));
    }
}
