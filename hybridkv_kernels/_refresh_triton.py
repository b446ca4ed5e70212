"""Triton kernels of the refresh step (launcher and the torch reference: ``refresh_step.py``).

Three kernels a layer-step, whatever the trigger decides (a CUDA graph can replay them):

* ``refresh_scores_kernel`` (one program per refreshed head): the held mask, the exact log-mass
  of what the device holds (kept slots, fixed entries, window, generated rows), the low-rank
  log-mass of the evicted tokens and the head's drift; the candidates' scores (low-rank, the
  moving slots' exact, -inf for fixed entries).
* ``refresh_trigger_kernel`` (one program): the layer's drift, the trigger (``rcr``'s shared
  threshold or ``periodic``'s clock), the fired flag and the device counters.
* ``refresh_candidates_kernel`` (one program per head): where the trigger fired, the candidates'
  exact logits from their keys read in place in host memory (pinned on CUDA); where it did
  not, no byte is read and the logits are zeros.
"""

import triton
import triton.language as tl

# Channels a tl.dot step: a whole [BLOCK_G, 128] fp32 query beside [32, 128] fp32 keys ("ieee"
# products, no tensor cores) took 255 registers and spilled on sm_90; 16 at a time do not.
BLOCK_DK = tl.constexpr(16)


@triton.jit
def _group_logits(q_row, stride_qg, G, k_rows, mask_n, D,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_G, BLOCK_N] fp32: the group's queries (rows of ``q_row``) · the keys starting at the
    pointers ``k_rows`` [BLOCK_N], BLOCK_DK channels at a time (exact fp32 products)."""
    off_g = tl.arange(0, BLOCK_G)
    x = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
        off_d = d0 + tl.arange(0, BLOCK_DK)
        mask_d = off_d < D
        q = tl.load(q_row + off_g[:, None] * stride_qg + off_d[None, :],
                    mask=(off_g < G)[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_rows[:, None] + off_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        x += tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return x


@triton.jit
def refresh_scores_kernel(
    Q, HEADS, SK, SLOT_BASE, GK, COUNT, BASIS, CODES, LSCALE, RESIDENT, FIXED, HELD, SCORE, KEPT, DRIFT,
    G, D, R, P, n_held, c, n_fixed, n_gen, scale,
    stride_qh, stride_qg, stride_skt, stride_gkh, stride_gkt,
    COUNTED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program h (refreshed head h, KV head HEADS[h]).

    HELD[h, p] = 1 for the positions held (RESIDENT[h, :c], FIXED[h, :n_fixed]); DRIFT[h] = sum
    over the group of sigmoid(log E - log R), E the low-rank softmax mass of the tokens not held,
    R the exact mass of the store rows SLOT_BASE[h] ... + n_held and of the generated rows
    (COUNT[0] of them when ``COUNTED``, else n_gen); SCORE[h, p] = max over the group of the
    low-rank logit, -inf where held, the exact logit at the moving slots' positions.
    """
    h = tl.program_id(0)
    head = tl.load(HEADS + h)
    off_g = tl.arange(0, BLOCK_G)
    off_n = tl.arange(0, BLOCK_N)
    off_p = tl.arange(0, BLOCK_P)
    off_r = tl.arange(0, BLOCK_R)
    mask_g = off_g < G
    q_row = Q + head * stride_qh
    held_row = HELD + h.to(tl.int64) * P
    score_row = SCORE + h.to(tl.int64) * P

    # the held mask, rebuilt from the slots' positions (they change when a refresh fires)
    for p0 in range(0, P, BLOCK_P):
        tl.store(held_row + p0 + off_p, tl.zeros([BLOCK_P], dtype=tl.int8), mask=p0 + off_p < P)
    tl.debug_barrier()
    for s0 in range(0, c, BLOCK_N):
        pos = tl.load(RESIDENT + h * c + s0 + off_n, mask=s0 + off_n < c, other=0)
        tl.store(held_row + pos, tl.full([BLOCK_N], 1, tl.int8), mask=s0 + off_n < c)
    for s0 in range(0, n_fixed, BLOCK_N):
        pos = tl.load(FIXED + h * n_fixed + s0 + off_n, mask=s0 + off_n < n_fixed, other=0)
        tl.store(held_row + pos, tl.full([BLOCK_N], 1, tl.int8), mask=s0 + off_n < n_fixed)
    tl.debug_barrier()

    # log R: exact logits of the held store rows (the first c: the moving slots), then generated rows
    base = tl.load(SLOT_BASE + h)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], dtype=tl.float32)
    for r0 in range(0, n_held, BLOCK_N):
        rows = r0 + off_n
        mask_n = rows < n_held
        x = _group_logits(q_row, stride_qg, G, SK + (base + rows) * stride_skt, mask_n, D,
                          BLOCK_G, BLOCK_N, BLOCK_D)  # [BLOCK_G, BLOCK_N], unscaled
        kept = tl.max(tl.where(mask_g[:, None], x, float("-inf")), 0)
        tl.store(KEPT + h * c + rows, kept, mask=rows < c)
        xs = tl.where(mask_n[None, :], x * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(xs, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xs - m_new[:, None]), 1)
        m = m_new
    if COUNTED:
        n_gen = tl.load(COUNT)
    gen_row = GK + head.to(tl.int64) * stride_gkh
    for r0 in range(0, n_gen, BLOCK_N):
        rows = r0 + off_n
        mask_n = rows < n_gen
        x = _group_logits(q_row, stride_qg, G, gen_row + rows * stride_gkt, mask_n, D, BLOCK_G, BLOCK_N, BLOCK_D)
        xs = tl.where(mask_n[None, :], x * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(xs, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xs - m_new[:, None]), 1)
        m = m_new
    log_r = m + tl.log(s)

    # log E: low-rank logits of every token, the mass of those not held; the candidates' scores
    mask_r = off_r < R
    qp = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, BLOCK_DK):
        off_d = d0 + tl.arange(0, BLOCK_DK)
        mask_d = off_d < D
        q = tl.load(q_row + off_g[:, None] * stride_qg + off_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        basis = tl.load(BASIS + h * D * R + off_d[:, None] * R + off_r[None, :],
                        mask=mask_d[:, None] & mask_r[None, :], other=0.0)
        qp += tl.dot(q, basis, input_precision="ieee")
    lscale = tl.load(LSCALE + h * R + off_r, mask=mask_r, other=0.0)
    qp = qp * lscale[None, :]  # [BLOCK_G, BLOCK_R]
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    mass = tl.zeros([BLOCK_G], dtype=tl.float32)
    codes_row = CODES + h.to(tl.int64) * R * P
    for p0 in range(0, P, BLOCK_P):
        pos = p0 + off_p
        mask_p = pos < P
        codes = tl.load(codes_row + off_r[:, None] * P + pos[None, :], mask=mask_r[:, None] & mask_p[None, :],
                        other=0).to(tl.float32)
        a = tl.dot(qp, codes, input_precision="ieee")  # [BLOCK_G, BLOCK_P]
        held = tl.load(held_row + pos, mask=mask_p, other=1)
        top_new = tl.maximum(top, tl.max(tl.where(mask_p[None, :], a, float("-inf")), 1))
        evicted = (held == 0)[None, :] & mask_p[None, :]
        e = tl.where(evicted, tl.exp((a - top_new[:, None]) * scale), 0.0)
        mass = mass * tl.exp((top - top_new) * scale) + tl.sum(e, 1)
        top = top_new
        best = tl.max(tl.where(mask_g[:, None], a, float("-inf")), 0)
        tl.store(score_row + pos, tl.where(held != 0, float("-inf"), best), mask=mask_p)
    log_e = tl.log(mass) + top * scale
    drift = tl.where(mask_g, tl.sigmoid(log_e - log_r), 0.0)
    tl.store(DRIFT + h, tl.sum(drift, 0))
    tl.debug_barrier()
    for s0 in range(0, c, BLOCK_N):  # the moving slots score by their exact logit
        sl = s0 + off_n
        pos = tl.load(RESIDENT + h * c + sl, mask=sl < c, other=0)
        tl.store(score_row + pos, tl.load(KEPT + h * c + sl, mask=sl < c, other=0.0), mask=sl < c)


@triton.jit
def refresh_trigger_kernel(
    DRIFT, TAU, CLOCK, FIRED, REFRESHES, KEY_READS, n_heads, denom, rate, eta, period, key_bytes,
    PERIODIC: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program: the layer's drift (the heads' sums over ``denom`` = heads x group), the
    trigger, FIRED, and the counters (REFRESHES += fired, KEY_READS += fired x key_bytes)."""
    off = tl.arange(0, BLOCK_H)
    drift = tl.sum(tl.load(DRIFT + off, mask=off < n_heads, other=0.0), 0) / denom
    if PERIODIC:  # steps 1, 1 + T, ...
        clock = tl.load(CLOCK) + 1
        tl.store(CLOCK, clock)
        fired = ((clock - 1) % period) == 0
    else:  # tau <- tau exp(eta (f - rate)); an unset tau (< 0) starts at this drift
        tau = tl.load(TAU)
        tau = tl.where(tau < 0, drift, tau)
        fired = drift > tau
        tl.store(TAU, tau * tl.exp(eta * (fired.to(tl.float32) - rate)))
    tl.store(FIRED, fired)
    tl.store(REFRESHES, tl.load(REFRESHES) + fired.to(tl.int64))
    tl.store(KEY_READS, tl.load(KEY_READS) + fired.to(tl.int64) * key_bytes)


@triton.jit
def refresh_candidates_kernel(
    Q, HEADS, HK, CAND, EXACT, FIRED, G, D, n_cand,
    stride_qh, stride_qg, stride_hkh, stride_hkp,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program h: EXACT[h, j] = max over the group of q · HK[h, CAND[h, j]] where FIRED (the keys
    read in place from host memory), zeros where it is not (nothing read)."""
    h = tl.program_id(0)
    off_n = tl.arange(0, BLOCK_N)
    out = EXACT + h * n_cand
    if tl.load(FIRED) != 0:
        head = tl.load(HEADS + h)
        mask_g = tl.arange(0, BLOCK_G) < G
        for j0 in range(0, n_cand, BLOCK_N):
            j = j0 + off_n
            mask_n = j < n_cand
            pos = tl.load(CAND + h * n_cand + j, mask=mask_n, other=0)
            x = _group_logits(Q + head * stride_qh, stride_qg, G, HK + h.to(tl.int64) * stride_hkh + pos * stride_hkp,
                              mask_n, D, BLOCK_G, BLOCK_N, BLOCK_D)
            tl.store(out + j, tl.max(tl.where(mask_g[:, None], x, float("-inf")), 0), mask=mask_n)
    else:
        for j0 in range(0, n_cand, BLOCK_N):
            j = j0 + off_n
            tl.store(out + j, tl.zeros([BLOCK_N], dtype=tl.float32), mask=j < n_cand)
