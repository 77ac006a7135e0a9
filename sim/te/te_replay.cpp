#include "sim/te/te_replay.hpp"

#include <algorithm>
#include <sstream>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"
#include "reference/bracketed_list.hpp"

// Source names below are relative to transformer_engine/ in TE's repository: pytorch/attention/dot_product_attention/
// {context_parallel.py, utils.py, dot_product_attention.py, backends.py}, pytorch/cpp_extensions/fused_attn.py and
// common/fused_attn/{fused_attn.cpp, fused_attn_f16_arbitrary_seqlen.cu}. Line numbers are those of the commit
// kTeVersion names (docs/te-audit.md lists them with what each one does).

namespace cpgold::sim {

namespace {

using V = std::vector<int32_t>;

std::string show(const V& v) { return bracketed_list(v); }
std::string show(Window w) { return "(" + std::to_string(w.left) + ", " + std::to_string(w.right) + ")"; }

// context_parallel.py:210-233, get_cu_seqlens_on_cp_rank.
V te_cu_seqlens_on_cp_rank(const V& cu, const V& cu_padded_on_rank, int cp_size, int rank, bool first, bool second) {
  V out(cu.size(), 0);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t seqlen = cu[b + 1] - cu[b];
    const int64_t padded = (cu_padded_on_rank[b + 1] - cu_padded_on_rank[b]) / 2;
    int64_t n = 0;
    if (first) n += std::clamp<int64_t>(seqlen - static_cast<int64_t>(rank) * padded, 0, padded);
    if (second) n += std::clamp<int64_t>(seqlen - static_cast<int64_t>(2 * cp_size - rank - 1) * padded, 0, padded);
    out[b + 1] = out[b] + static_cast<int32_t>(n);
  }
  return out;
}

V floor_div(const V& v, int d) {  // torch's // on the non-negative int32 tensors TE divides
  V out;
  for (int32_t x : v) out.push_back(x / d);
  return out;
}
V diff(const V& cu) {
  V out;
  for (size_t b = 1; b < cu.size(); ++b) out.push_back(cu[b] - cu[b - 1]);
  return out;
}

bool is_causal_mask(const std::string& mask) { return mask.find("causal") != std::string::npos; }
bool sliding_window(Window w) { return !(w.left == -1 && (w.right == -1 || w.right == 0)); }

// fused_attn.py:325-329: bottom_right_diagonal defaults to True only for the *_bottom_right mask types; no CP call
// passes it.
bool fused_bottom_right_default(const std::string& mask) {
  return mask == "causal_bottom_right" || mask == "padding_causal_bottom_right";
}

// utils.py:2642-2684, check_set_window_size (called from dot_product_attention.py:1745).
void normalise_window(TeReplay& r) {
  const std::optional<Window>& given = r.user.window_size;
  const std::string& mask = r.attn_mask_type;
  if (is_causal_mask(mask)) {
    if (!given) {
      r.window_size = {-1, 0};
    } else if ((given->left == -1 && given->right == -1) || (given->left >= 0 && given->right != 0)) {
      r.window_size = {given->left, 0};
      r.normalisations.push_back({"window_size " + show(*given) + " with attn_mask_type " + mask + " becomes " +
                                      show(r.window_size) + " (warning: window_size should be (-1, 0) or (>=0, 0))",
                                  "utils.py:2659-2665"});
    } else if (!(given->left == -1 && given->right == 0) && (given->left < 0 || given->right != 0)) {
      r.refusal = TeNote{"AssertionError: window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + mask +
                             " (window_size " + show(*given) + ")",
                         "utils.py:2666-2669"};
    } else {
      r.window_size = *given;
    }
  } else {
    if (!given) {
      r.window_size = {-1, -1};
    } else if (given->left == -1 && given->right == 0) {
      r.window_size = {-1, -1};
      r.normalisations.push_back({"window_size (-1, 0) with attn_mask_type " + mask +
                                      " becomes (-1, -1): full attention, not causal (warning: window_size should be "
                                      "(-1, -1) or (>=0, >=0))",
                                  "utils.py:2673-2677"});
    } else if (!(given->left == -1 && given->right == -1) && (given->left < 0 || given->right < 0)) {
      r.refusal = TeNote{"AssertionError: window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + mask +
                             " (window_size " + show(*given) + ")",
                         "utils.py:2678-2681"};
    } else {
      r.window_size = *given;
    }
  }
}

// get_attention_backend (utils.py:393) for one backend: the first filter that disables it, in TE's order.
std::optional<TeNote> backend_gate(const CaseSpec& spec, const TeReplay& r, CommType user_comm) {
  const bool fused = r.backend == TeBackend::fused;
  const std::string comm(comm_name(user_comm));
  const int hq = spec.heads_q, hk = heads_kv(spec), dqk = spec.dim_qk, dv = dim_v(spec);
  const bool causal = is_causal_mask(r.attn_mask_type);
  const Window w = r.window_size;
  if (spec.dtype != DType::bf16 && spec.dtype != DType::fp16) {
    if (fused)
      return TeNote{"Disabling FusedAttention for unsupported qkv_dtype = torch.float32 (supported: bf16, fp16, fp8)",
                    "utils.py:628-645"};
    return TeNote{"Disabling FlashAttention 3 for unsupported qkv_dtype = torch.float32 (supported: bf16, fp16, fp8)",
                  "utils.py:614-627"};
  }
  if (!fused) {
    // utils.py:952-963, _is_fa3_supported.
    bool ok = dqk <= 256 && hq % hk == 0;
    if (ok && dqk != dv) ok = (128 < dqk && dqk <= 192 && 96 < dv && dv <= 128) || (dqk <= 64 && dv <= 512);
    if (!ok)
      return TeNote{"Disabling FlashAttention 3 due to unsupported num_heads, num_gqa_groups, head_dim_qk, head_dim_v "
                    "(head_dim_qk = " + std::to_string(dqk) + ", head_dim_v = " + std::to_string(dv) + ")",
                    "utils.py:950-983"};
    if (causal && r.max_seqlen_q != r.max_seqlen_kv)
      return TeNote{"Disabling FlashAttention as it does not support context parallelism with causal masking for "
                    "cross-attention (max_seqlen_q " + std::to_string(r.max_seqlen_q) + " != max_seqlen_kv " +
                    std::to_string(r.max_seqlen_kv) + ")",
                    "utils.py:1195-1200"};
    return std::nullopt;
  }
  if (causal && r.max_seqlen_q != r.max_seqlen_kv)
    return TeNote{"Disabling FusedAttention as it does not support context parallelism with causal masking for "
                  "cross-attention (max_seqlen_q " + std::to_string(r.max_seqlen_q) + " != max_seqlen_kv " +
                  std::to_string(r.max_seqlen_kv) + ")",
                  "utils.py:1221-1226"};
  if (sliding_window(w) && (user_comm == CommType::p2p || user_comm == CommType::a2a_p2p))
    return TeNote{"Disabling FusedAttention as it does not support context parallelism with sliding window attention "
                  "and cp_comm_type = " + comm + " (window_size " + show(w) + ")",
                  "utils.py:1261-1271"};
  if ((user_comm == CommType::a2a || user_comm == CommType::a2a_p2p) && (hq % 2 != 0 || hk % 2 != 0))
    return TeNote{"Disabling FusedAttention as cp_comm_type = " + comm + " requires num_heads and num_gqa_groups "
                  "divisible by 2 (got num_heads = " + std::to_string(hq) + ", num_gqa_groups = " +
                  std::to_string(hk) + ")",
                  "utils.py:1272-1280"};
  if (sliding_window(w) && r.max_seqlen_q > r.max_seqlen_kv)
    return TeNote{"Disabling FusedAttention as it does not support sliding window attention with s_q > s_kv for "
                  "cross-attention (max_seqlen_q " + std::to_string(r.max_seqlen_q) + " > max_seqlen_kv " +
                  std::to_string(r.max_seqlen_kv) + ")",
                  "utils.py:1344-1365"};
  // nvte_get_fused_attn_backend on sm90 (fused_attn.cpp:310-356): head dims multiples of 8, at most 128, or at most
  // 256 on Hopper in training; the MLA exclusion of cuDNN 9.11+ for Hopper backward.
  const bool dims_ok = dqk % 8 == 0 && dv % 8 == 0 && ((dqk <= 128 && dv <= 128) || (dqk <= 256 && dv <= 256));
  const bool mla_bug = dqk >= 128 && dv >= 128 && !(dqk == 192 && dv == 128) && dqk != dv;
  if (!dims_ok || mla_bug)
    return TeNote{"Disabling FusedAttention as no backend supports the provided input (nvte_get_fused_attn_backend: "
                  "head_dim_qk = " + std::to_string(dqk) + ", head_dim_v = " + std::to_string(dv) +
                  " on sm90, fused_attn.cpp:310-356)",
                  "utils.py:1490-1491"};
  return std::nullopt;
}

// The per-call check fused_attn_fwd/bwd repeat in C++ (fused_attn.cpp:633-655): a sliding window needs
// max_seqlen_q <= max_seqlen_kv (fused_attn.cpp:447-461), else no backend and NVTE_ERROR.
std::optional<TeNote> fused_call_gate(const TeCall& c) {
  if (sliding_window(c.window) && c.max_seqlen_q > c.max_seqlen_kv)
    return TeNote{"NVTE_ERROR: Invalid combination of data type and sequence length for fused attention "
                  "(rank " + std::to_string(c.rank) + " step " + std::to_string(c.step) + ": window_size " +
                  show(c.window) + " with max_seqlen_q " + std::to_string(c.max_seqlen_q) + " > max_seqlen_kv " +
                  std::to_string(c.max_seqlen_kv) + ", fused_attn.cpp:447-461)",
                  "fused_attn.cpp:633-655"};
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------------------------
// P2P ring (AttnFuncWithCPAndKVP2P, context_parallel.py:1356-2970); also the ring of a2a+p2p.

struct RingInputs {
  V cu_q, cu_kv;            // global actual cu_seqlens (never divided)
  V cuP_q, cuP_kv;          // context_parallel.py:1447-1448: cu_seqlens_*_padded // cp_size (cp_size = ring size)
  int32_t max_q = 0, max_kv = 0;  // context_parallel.py:1449-1450: max_seqlen_* // cp_size
  int P = 1, A = 1;
  bool causal = false;
  std::string mask;
  int hq = 0;
};

TeCall ring_call(const TeReplay& r, const RingInputs& in, PassKind pass, int p, int j, int step) {
  const int P = in.P;
  // Forward step i reads the KV of owner (p - i) mod P; backward step i replays forward step P-1-i, whose owner is
  // (p + 1 + i) mod P (context_parallel.py:2490-2630 takes cu_seqlens_*_per_step[cp_size - step - 1]).
  const int fwd_step = pass == PassKind::forward ? step : P - 1 - step;
  const int o = ((p - fwd_step) % P + P) % P;
  TeCall c;
  c.pass = pass;
  c.rank = p * in.A + j;
  c.step = step;
  c.kv_owner = o * in.A + j;
  c.head_group = j;
  c.head_begin = j * (in.hq / in.A);
  c.head_end = (j + 1) * (in.hq / in.A);
  c.q_shard = p;
  c.kv_shard = o;
  c.q_scope[0] = p;
  c.q_scope[1] = 2 * P - 1 - p;
  c.kv_scope[0] = o;
  c.kv_scope[1] = 2 * P - 1 - o;
  // Sections: forward context_parallel.py:1797-1900 (i == 0 diagonal, i <= rank lower, else upper; "all" when not
  // causal); backward context_parallel.py:2581-2630 (i == cp_size-1 diagonal, i >= cp_size-rank-1 lower).
  if (!in.causal) c.section = "all";
  else if (fwd_step == 0) c.section = "diagonal";
  else if (fwd_step <= p) c.section = "lower-triangle";
  else c.section = "upper-triangle";
  const bool diag_or_all = c.section == "diagonal" || c.section == "all";
  const bool lower = c.section == "lower-triangle", upper = c.section == "upper-triangle";

  // cp_p2p_fwd_prepare_qkv (context_parallel.py:691-807): per-step actual counts, and the read_half of K/V (lower)
  // or Q (upper).
  V cu_q_step, cu_kv_step;
  if (r.pad_between_seqs) {
    const int kv_rank = c.section == "diagonal" ? p : o;
    cu_q_step = te_cu_seqlens_on_cp_rank(in.cu_q, in.cuP_q, P, p, !upper, true);
    cu_kv_step = te_cu_seqlens_on_cp_rank(in.cu_kv, in.cuP_kv, P, kv_rank, true, !lower);
  } else {
    cu_q_step = floor_div(in.cu_q, upper ? 2 * P : P);
    cu_kv_step = floor_div(in.cu_kv, lower ? 2 * P : P);
  }
  c.q_tensor = upper ? TeTensor::second_half : TeTensor::rank_local;
  c.kv_tensor = lower ? TeTensor::first_half : TeTensor::rank_local;
  const int32_t max_q = upper ? in.max_q / 2 : in.max_q;
  const int32_t max_kv = lower ? in.max_kv / 2 : in.max_kv;
  const V pad_q = upper ? floor_div(in.cuP_q, 2) : in.cuP_q;
  const V pad_kv = lower ? floor_div(in.cuP_kv, 2) : in.cuP_kv;
  const bool fwd = pass == PassKind::forward;
  if (r.backend == TeBackend::fused) {
    // cp_p2p_fwd_fused_attn (context_parallel.py:854-916) and cp_p2p_bwd_fused_attn (1165-1181): no window_size and
    // no bottom_right_diagonal are passed, so fused_attn_fwd's defaults (-1, -1) and fused_attn.py:325-329 apply.
    c.cu_seqlens_q = cu_q_step;
    c.cu_seqlens_kv = cu_kv_step;
    c.cu_seqlens_q_padded = pad_q;
    c.cu_seqlens_kv_padded = pad_kv;
    c.max_seqlen_q = max_q;
    c.max_seqlen_kv = max_kv;
    c.attn_mask_type = diag_or_all ? in.mask : "padding";
    c.causal = is_causal_mask(c.attn_mask_type);
    c.window = {-1, -1};
    c.bottom_right = fused_bottom_right_default(c.attn_mask_type);
    c.source = fwd ? (diag_or_all ? "context_parallel.py:854-869,932-957"
                                  : (lower ? "context_parallel.py:871-885,932-957" : "context_parallel.py:886-916,932-957"))
                   : (diag_or_all ? "context_parallel.py:1165-1169,1224-1251"
                                  : (lower ? "context_parallel.py:1171-1176,1224-1251" : "context_parallel.py:1177-1181,1224-1251"));
  } else {
    // cp_p2p_fwd_flash_attn (context_parallel.py:969-1047) and cp_p2p_bwd_flash_attn (1257-1353): causal only on the
    // diagonal, window (-1, 0) there (fa_forward_kwargs, 1636-1641) and (-1, -1) elsewhere; with pad_between_seqs
    // cu_seqlens become the padded offsets (halved for the half tensors) and seqused the per-step counts.
    c.causal = c.section == "diagonal";
    c.window = c.causal ? Window{-1, 0} : Window{-1, -1};
    c.bottom_right = true;
    c.max_seqlen_q = max_q;
    c.max_seqlen_kv = max_kv;
    if (r.pad_between_seqs) {
      c.seqused_q = diff(cu_q_step);
      c.seqused_k = diff(cu_kv_step);
      c.cu_seqlens_q = pad_q;
      c.cu_seqlens_kv = pad_kv;
    } else {
      c.cu_seqlens_q = cu_q_step;
      c.cu_seqlens_kv = cu_kv_step;
    }
    c.source = fwd ? "context_parallel.py:990-1038" : "context_parallel.py:1296-1351";
  }
  return c;
}

void replay_ring(const CaseSpec& spec, TeReplay& r, const ThdLayout& l, int P, int A) {
  RingInputs in;
  in.cu_q = l.q.cu_seqlens;
  in.cu_kv = l.kv.cu_seqlens;
  in.cuP_q = floor_div(l.q.cu_seqlens_padded, P);
  in.cuP_kv = floor_div(l.kv.cu_seqlens_padded, P);
  in.max_q = r.max_seqlen_q / P;
  in.max_kv = r.max_seqlen_kv / P;
  in.P = P;
  in.A = A;
  in.causal = is_causal_mask(r.attn_mask_type);  // context_parallel.py:1424
  in.mask = r.attn_mask_type;
  in.hq = spec.heads_q;
  for (int g = 0; g < P * A; ++g)
    for (int i = 0; i < P; ++i) {
      r.forward.push_back(ring_call(r, in, PassKind::forward, g / A, g % A, i));
      r.backward.push_back(ring_call(r, in, PassKind::backward, g / A, g % A, i));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// a2a (AttnFuncWithCPAndQKVOA2A, context_parallel.py:4170-4921): one call per rank on the global sequences.

void replay_a2a(const CaseSpec& spec, TeReplay& r, const ThdLayout& l) {
  const int W = r.cp_size;
  for (PassKind pass : {PassKind::forward, PassKind::backward})
    for (int rank = 0; rank < W; ++rank) {
      TeCall c;
      c.pass = pass;
      c.rank = rank;
      c.step = 0;
      c.section = "a2a";
      c.head_group = rank;
      c.head_begin = rank * (spec.heads_q / W);
      c.head_end = (rank + 1) * (spec.heads_q / W);
      c.q_tensor = c.kv_tensor = TeTensor::sequence_order;
      c.max_seqlen_q = r.max_seqlen_q;
      c.max_seqlen_kv = r.max_seqlen_kv;
      c.window = r.window_size;
      const bool fwd = pass == PassKind::forward;
      if (r.backend == TeBackend::fused) {
        // context_parallel.py:4400-4427 (forward), 4749-4779 (backward): the user's mask and window, global
        // cu_seqlens and padded offsets, bottom_right_diagonal by default.
        c.cu_seqlens_q = l.q.cu_seqlens;
        c.cu_seqlens_kv = l.kv.cu_seqlens;
        c.cu_seqlens_q_padded = l.q.cu_seqlens_padded;
        c.cu_seqlens_kv_padded = l.kv.cu_seqlens_padded;
        c.attn_mask_type = r.attn_mask_type;
        c.causal = is_causal_mask(c.attn_mask_type);
        c.bottom_right = fused_bottom_right_default(c.attn_mask_type);
        c.source = fwd ? "context_parallel.py:4400-4427" : "context_parallel.py:4749-4779";
      } else {
        // context_parallel.py:4441-4468 (forward), 4789-4827 (backward).
        c.causal = is_causal_mask(r.attn_mask_type);
        c.bottom_right = true;
        if (r.pad_between_seqs) {
          c.seqused_q = diff(l.q.cu_seqlens);
          c.seqused_k = diff(l.kv.cu_seqlens);
          c.cu_seqlens_q = l.q.cu_seqlens_padded;
          c.cu_seqlens_kv = l.kv.cu_seqlens_padded;
        } else {
          c.cu_seqlens_q = l.q.cu_seqlens;
          c.cu_seqlens_kv = l.kv.cu_seqlens;
        }
        c.source = fwd ? "context_parallel.py:4441-4468" : "context_parallel.py:4789-4827";
      }
      (fwd ? r.forward : r.backward).push_back(std::move(c));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// all_gather (AttnFuncWithCPAndKVAllGather, context_parallel.py:2976-4167): two calls per rank, chunk r then chunk
// 2W-1-r, on the full local Q against the gathered K/V in sequence order.

// context_parallel.py:2976-3011, get_kv_seq_info_after_all_gather (the THD path uses the end bound and the window).
Window kv_seq_info_after_all_gather(int chunk, int W, int32_t msq, int32_t msk, Window w, int32_t* seq_end) {
  const int64_t chunk_end = static_cast<int64_t>(chunk + 1) * msk, full_end = static_cast<int64_t>(msk) * W * 2;
  Window out;
  int64_t end;
  if (w.right == -1) {
    end = full_end;
    out.right = -1;
  } else {
    end = std::min(full_end, chunk_end + w.right);
    out.right = static_cast<int32_t>(chunk_end + w.right - end);
  }
  out.left = w.left == -1 ? -1 : static_cast<int32_t>(w.left + end - chunk_end);
  (void)msq;  // only the start bound of the bshd/sbhd slice uses it
  *seq_end = static_cast<int32_t>(end);
  return out;
}

void replay_all_gather(const CaseSpec& spec, TeReplay& r, const ThdLayout& l) {
  const int W = r.cp_size;
  std::string mask = r.attn_mask_type;
  const bool causal_user = is_causal_mask(mask);
  // context_parallel.py:3078-3079: the fused path turns a causal mask into its bottom-right form.
  if (r.backend == TeBackend::fused && causal_user && mask.find("bottom_right") == std::string::npos) {
    mask += "_bottom_right";
    r.normalisations.push_back({"all_gather turns attn_mask_type " + r.attn_mask_type + " into " + mask +
                                    " for its per-chunk calls",
                                "context_parallel.py:3076-3079"});
  }
  const int32_t msq = r.max_seqlen_q / (2 * W), msk = r.max_seqlen_kv / (2 * W);  // context_parallel.py:3146-3147
  const V cuP_q_chunk = floor_div(l.q.cu_seqlens_padded, 2 * W);                    // 3150-3151
  V cuP_q_rank = cuP_q_chunk;                                                         // 3270
  for (int32_t& x : cuP_q_rank) x *= 2;
  const V chunk_q = diff(cuP_q_chunk);
  const bool windowed = sliding_window(r.window_size);  // 3312-3314
  for (int rank = 0; rank < W; ++rank)
    for (int s = 0; s < 2; ++s) {
      const int chunk = s == 0 ? rank : 2 * W - 1 - rank;  // 3254
      // Q counts and offsets per step (3274-3303).
      const V cu_q_step = te_cu_seqlens_on_cp_rank(l.q.cu_seqlens, cuP_q_rank, W, rank, s == 0, s == 1);
      V pad_q_step = cuP_q_rank;
      if (s == 1)
        for (size_t b = 0; b + 1 < pad_q_step.size(); ++b) pad_q_step[b] += chunk_q[b];
      // K/V visible counts (3305-3337).
      V cu_kv_step = l.kv.cu_seqlens;
      if (causal_user || windowed) {
        cu_kv_step.assign(l.kv.cu_seqlens.size(), 0);
        for (int b = 0; b < l.batch(); ++b) {
          const int64_t chunk_kv = l.kv.padded_length(b) / (2 * W);
          int64_t visible = chunk_kv * (chunk + 1);
          if (r.window_size.right > 0) visible += r.window_size.right;
          cu_kv_step[static_cast<size_t>(b) + 1] =
              cu_kv_step[static_cast<size_t>(b)] + static_cast<int32_t>(std::min<int64_t>(l.kv.length(b), visible));
        }
      }
      int32_t seq_end = 0;
      // 3395-3397: the step's window and max_seqlen_kv (the causal flag there is "causal" in the mask type).
      const Window step_window = kv_seq_info_after_all_gather(chunk, W, msq, msk, r.window_size, &seq_end);
      for (PassKind pass : {PassKind::forward, PassKind::backward}) {
        TeCall c;
        c.pass = pass;
        c.rank = rank;
        c.step = s;
        c.section = "chunk " + std::to_string(chunk);
        c.head_begin = 0;
        c.head_end = spec.heads_q;
        c.q_tensor = TeTensor::rank_local;
        c.kv_tensor = TeTensor::sequence_order;
        c.q_shard = rank;
        c.q_scope[0] = chunk;
        c.max_seqlen_q = msq;
        c.max_seqlen_kv = seq_end;
        c.window = step_window;
        const bool fwd = pass == PassKind::forward;
        if (r.backend == TeBackend::fused) {
          // 3404-3446 (forward), 3891-3981 (backward).
          c.cu_seqlens_q = cu_q_step;
          c.cu_seqlens_kv = cu_kv_step;
          c.cu_seqlens_q_padded = pad_q_step;
          c.cu_seqlens_kv_padded = l.kv.cu_seqlens_padded;
          c.attn_mask_type = mask;
          c.causal = is_causal_mask(mask);
          c.bottom_right = fused_bottom_right_default(mask);
          c.source = fwd ? "context_parallel.py:3404-3446" : "context_parallel.py:3891-3981";
        } else {
          // 3457-3496 (forward), 3999-4050 (backward): always seqused on THD (not only with pad_between_seqs).
          c.causal = causal_user;
          c.bottom_right = true;
          c.seqused_q = diff(cu_q_step);
          c.seqused_k = diff(cu_kv_step);
          c.cu_seqlens_q = pad_q_step;
          c.cu_seqlens_kv = l.kv.cu_seqlens_padded;
          c.source = fwd ? "context_parallel.py:3457-3496" : "context_parallel.py:3999-4050";
        }
        (fwd ? r.forward : r.backward).push_back(std::move(c));
      }
    }
}

}  // namespace

std::string_view te_backend_name(TeBackend backend) { return backend == TeBackend::fused ? "fused" : "flash3"; }
std::string_view te_backend_title(TeBackend backend) {
  return backend == TeBackend::fused ? "cuDNN FusedAttention (F16_arbitrary_seqlen)" : "FlashAttention-3";
}
constexpr std::pair<TeTensor, std::string_view> kTeTensorNames[] = {
    {TeTensor::rank_local, "full"}, {TeTensor::first_half, "first_half"}, {TeTensor::second_half, "second_half"},
    {TeTensor::sequence_order, "sequence_order"}};

std::string_view te_tensor_name(TeTensor tensor) { return name_in(kTeTensorNames, tensor); }

std::string_view te_half_name(HalfSelect half) {
  return te_tensor_name(half == HalfSelect::full    ? TeTensor::rank_local
                        : half == HalfSelect::first ? TeTensor::first_half
                                                    : TeTensor::second_half);
}

TeUserArguments te_user_arguments(const nlohmann::json& case_object) {
  TeUserArguments u;
  if (case_object.contains("mask") && case_object["mask"] == "causal") u.attn_mask_type = "padding_causal";
  if (case_object.contains("window")) {
    const auto& w = case_object["window"];
    u.window_size = Window{w[0].get<int32_t>(), w[1].get<int32_t>()};
  }
  return u;
}

TeUserArguments te_user_arguments(const CaseSpec& spec) {
  TeUserArguments u;
  const Window w = mask_window(spec);
  if (spec.causal) u.attn_mask_type = "padding_causal";
  const Window default_window = spec.causal ? Window{-1, 0} : Window{-1, -1};
  if (!(w == default_window)) u.window_size = w;
  return u;
}

TeReplay replay_te(const CaseSpec& spec, const TeUserArguments& user, TeBackend backend, bool pad_between_seqs) {
  validate_case(spec);
  if (spec.cp_size < 2)
    fail_input("cp_size", "value ", spec.cp_size, ": TransformerEngine runs cp_size 1 without context parallelism, "
               "which the replay does not cover (it needs cp_size >= 2)");
  const ThdLayout l = layout(spec);
  TeReplay r;
  r.backend = backend;
  r.pad_between_seqs = pad_between_seqs;
  r.user = user;
  r.attn_mask_type = user.attn_mask_type;
  r.global = l;
  r.cp_size = spec.cp_size;
  // dot_product_attention.py:1800-1811: max_seqlen from the padded lengths, rounded up to a multiple of 64.
  r.max_seqlen_q = te_max_seqlen(l.q);
  r.max_seqlen_kv = te_max_seqlen(l.kv);
  normalise_window(r);
  if (r.refusal) return r;
  if (auto gate = backend_gate(spec, r, spec.comm)) {
    r.refusal = gate;
    return r;
  }
  // attn_forward_func_with_cp (context_parallel.py:5024-5032): a2a+p2p with a group of one falls back.
  CommType comm = spec.comm;
  int A = 1, P = spec.cp_size;
  if (comm == CommType::a2a_p2p) {
    A = a2a_size(spec);
    P = spec.cp_size / A;
    if (A == 1 || P == 1) {
      comm = A == 1 ? CommType::p2p : CommType::a2a;
      r.normalisations.push_back({std::string("a2a+p2p with ") + (A == 1 ? "a2a groups of 1 runs as p2p" :
                                  "a p2p group of 1 runs as a2a"), "context_parallel.py:5027-5032"});
      A = comm == CommType::a2a ? spec.cp_size : 1;
      P = comm == CommType::p2p ? spec.cp_size : 1;
    }
  }
  r.comm = comm;
  r.a2a_size = comm == CommType::a2a ? spec.cp_size : A;
  r.p2p_size = comm == CommType::a2a || comm == CommType::all_gather ? 1 : P;
  // context_parallel.py:5054-5061: sliding windows only on a2a and all_gather (after the fallback above).
  if (sliding_window(r.window_size) && (comm == CommType::p2p || comm == CommType::a2a_p2p)) {
    r.refusal = TeNote{"AssertionError: Context parallelism does not support sliding window attention with "
                       "cp_comm_type='" + std::string(comm_name(comm)) + "'! (window_size " + show(r.window_size) + ")",
                       "context_parallel.py:5054-5061"};
    return r;
  }
  // backends.py:1113-1122: with pad_between_seqs False, FlashAttention hands cu_seqlens to the CP functions in place
  // of cu_seqlens_padded, so every offset TE derives (and every reorder and read_half) assumes no padding between
  // sequences. The calls below use the offsets TE receives; `misread` says when they are not the layout's.
  ThdLayout passed = l;
  if (!pad_between_seqs && backend == TeBackend::flash3) {
    passed.q.cu_seqlens_padded = l.q.cu_seqlens;
    passed.kv.cu_seqlens_padded = l.kv.cu_seqlens;
    if (l.q.cu_seqlens != l.q.cu_seqlens_padded || l.kv.cu_seqlens != l.kv.cu_seqlens_padded)
      r.misread = TeNote{"pad_between_seqs=False: FlashAttention passes cu_seqlens_q " + show(l.q.cu_seqlens) +
                             " as cu_seqlens_q_padded and cu_seqlens_kv " + show(l.kv.cu_seqlens) +
                             " as cu_seqlens_kv_padded, but this layout's padded offsets are " +
                             show(l.q.cu_seqlens_padded) + " / " + show(l.kv.cu_seqlens_padded) +
                             ": every read_half, reorder and attention call reads rows at offsets of a layout "
                             "without padding",
                         "backends.py:1113-1122"};
  }
  r.level = make_partition(l, comm == CommType::a2a ? 1 : (comm == CommType::all_gather ? spec.cp_size : P), false);
  switch (comm) {
    case CommType::p2p: replay_ring(spec, r, passed, P, 1); break;
    case CommType::a2a_p2p: replay_ring(spec, r, passed, P, A); break;
    case CommType::a2a: replay_a2a(spec, r, passed); break;
    case CommType::all_gather: replay_all_gather(spec, r, passed); break;
  }
  if (backend == TeBackend::fused)
    for (const auto* calls : {&r.forward, &r.backward})
      for (const TeCall& c : *calls)
        if (auto gate = fused_call_gate(c)) {
          r.refusal = gate;
          r.forward.clear();
          r.backward.clear();
          return r;
        }
  return r;
}

TeSequenceArgs te_sequence_args(const TeCall& c, TeBackend backend, int b) {
  const size_t i = static_cast<size_t>(b);
  TeSequenceArgs a;
  if (backend == TeBackend::fused) {
    // fused_attn_f16_arbitrary_seqlen.cu: ragged offsets from cu_seqlens_*_padded, lengths from cu_seqlens_*.
    a.q_first_row = c.cu_seqlens_q_padded[i];
    a.kv_first_row = c.cu_seqlens_kv_padded[i];
    a.q_count = c.cu_seqlens_q[i + 1] - c.cu_seqlens_q[i];
    a.kv_count = c.cu_seqlens_kv[i + 1] - c.cu_seqlens_kv[i];
  } else {
    // FlashAttention-3: sequence b starts at cu_seqlens[b]; its length is seqused[b] if given, else the difference.
    a.q_first_row = c.cu_seqlens_q[i];
    a.kv_first_row = c.cu_seqlens_kv[i];
    a.q_count = c.seqused_q.empty() ? c.cu_seqlens_q[i + 1] - c.cu_seqlens_q[i] : c.seqused_q[i];
    a.kv_count = c.seqused_k.empty() ? c.cu_seqlens_kv[i + 1] - c.cu_seqlens_kv[i] : c.seqused_k[i];
  }
  return a;
}

}  // namespace cpgold::sim
