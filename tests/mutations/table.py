"""One-line mutations of the papers' defining formulas that the fast tier must catch (issue 31, item 2).

Each entry names the file, the exact source fragment (it must occur exactly once in that file: a fragment that
moved or changed makes the check fail loudly instead of testing nothing), its replacement, the formula it breaks,
and the test files to run, the variant's paper pins first (``-x`` stops at the first failure). ``test_mutations``
applies one at a time to a temporary copy of ``core/``, ``model/`` and ``tests/`` and requires pytest's exit
code 1 (tests failed; 2+ would be a collection or usage error, which proves nothing).

The first five are the issue's table. ``caught_by`` names, for each, the test that catches it: the check runs that
one test first and stops there when it fails (a second or two per mutation); only when it passes does it run the
whole list, which must still fail, and the check then says which test to name instead (run ``pytest -m slow
tests/mutations -rA`` to see every catcher).
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = ("tests/attention/full/test_paper.py", "tests/attention/focal/test_module.py")
FOCAL = ("tests/attention/focal/test_paper.py", "tests/attention/focal/test_module.py")
LAZY = (
    "tests/attention/lazy/test_paper.py",
    "tests/attention/lazy/test_module.py",
    "tests/attention/lazy/test_flex.py",
)
FOCUS = (
    "tests/attention/focus/test_paper.py",
    "tests/attention/focus/test_module.py",
    "tests/attention/focus/test_sinkhorn.py",
    "tests/attention/focus/test_hard.py",
    "tests/attention/focus/test_soft.py",
)
DGA = (
    "tests/attention/dga/test_paper.py",
    "tests/attention/dga/test_module.py",
    "tests/attention/dga/test_cpu.py",
    "tests/attention/dga/test_flex.py",
    "tests/attention/dga/test_cache.py",
)
HYPER = (
    "tests/attention/prescored_hyper/test_paper.py",
    "tests/attention/prescored_hyper/test_module.py",
    "tests/attention/prescored_hyper/test_scoring.py",
)
ROPE = ("tests/model/test_rope_paper.py", "tests/model/test_rope.py")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (exact original fragment, replacement), each fragment once in the file
    breaks: str  # the variant and formula it breaks
    tests: tuple[str, ...]  # test files to run, pins first
    caught_by: str  # the test that fails (a node id in one of ``tests``; lazy-bias-added fails there on the zero
    # table's gradient, which flips sign, and on values in the next pin)


MUTATIONS: tuple[Mutation, ...] = (
    # ---- the five ---------------------------------------------------------------------------------------
    Mutation(
        "focal-multiplies-by-tau",
        "model/attention/focal/module.py",
        (("(1.0 / self.tau(hidden, q_pos, cache))", "(self.tau(hidden, q_pos, cache))"),),
        "focal learned: logits multiplied by tau instead of divided (eq. 6)",
        FOCAL,
        "tests/attention/focal/test_paper.py::test_learned_temperature_is_the_whole_divisor_eq6[reference-query]",
    ),
    Mutation(
        "focal-prefix-sum",
        "model/attention/focal/naive.py",
        (("z = csum / (q_pos + 1).to(z.dtype)", "z = csum"),),
        "focal prefix_mean scope: the prefix sum instead of the mean",
        FOCAL,
        "tests/attention/focal/test_paper.py::test_learned_temperature_is_the_whole_divisor_eq6[reference-prefix_mean]",
    ),
    Mutation(
        "dga-importance-sum",
        "model/attention/dga/module.py",
        (("(a.sum(-2) / mask.sum(-2).clamp(min=1))", "(a.sum(-2))"),),
        "dga importance (eq. 16): the sum over sampled queries instead of the mean",
        DGA,
        "tests/attention/dga/test_paper.py::test_dga_is_focal_plus_aggregated_groups_eq14_to_17[reference-sequence-m2]",
    ),
    Mutation(
        "hyper-residual-weight-one",
        "model/attention/prescored_hyper/plan.py",
        (("torch.log(nv_h.clamp(min=1) / s_eff)", "torch.zeros_like(s_eff)"),),
        "prescored_hyper: residual columns weighted 1 instead of n/s",
        HYPER,
        "tests/attention/prescored_hyper/test_paper.py::test_residual_columns_weigh_n_over_s[reference]",
    ),
    Mutation(
        "lazy-bias-added",
        "model/attention/lazy/naive.py",
        (("- bias(q_pos, k_pos, distance_bias, last)", "+ bias(q_pos, k_pos, distance_bias, last)"),),
        "lazy reference: distance bias added instead of subtracted (eq. 3)",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_default_config_is_elastic_softmax_with_tau_over_n_eq5[reference]",
    ),
    # ---- full and focal -----------------------------------------------------------------------------------------
    Mutation(
        "full-scale-over-d",
        "model/attention/full/module.py",
        (("return 1.0 / math.sqrt(self.spec.head_dim)", "return 1.0 / self.spec.head_dim"),),
        "full: logits scaled by 1/d instead of 1/sqrt(d)",
        FULL,
        "tests/attention/full/test_paper.py::test_full_is_scaled_dot_product_softmax_eq1[reference]",
    ),
    Mutation(
        "focal-t-multiplies",
        "model/attention/focal/naive.py",
        (("return 1.0 / (t * math.sqrt(", "return t / (math.sqrt("),),
        "focal constant: t multiplies the logits instead of dividing them (eq. 5)",
        FOCAL,
        "tests/attention/focal/test_paper.py::test_constant_temperature_divides_the_logits_eq5[reference-0.4]",
    ),
    Mutation(
        "focal-no-clip",
        "model/attention/focal/naive.py",
        (("torch.clamp(offset + z, tau_min, tau_max)", "offset + z"),),
        "focal learned: tau not clipped to [tau_min, tau_max] (eq. 6)",
        FOCAL,
        "tests/attention/focal/test_paper.py::test_learned_temperature_is_the_whole_divisor_eq6[reference-query]",
    ),
    # ---- lazy ---------------------------------------------------------------------------------------------------
    Mutation(  # the FlexAttention path's own copy of eq. 3 (lazy-bias-added flipped both when they shared a file)
        "lazy-flex-bias-added",
        "model/attention/lazy/flex.py",
        (("return score - bias[h,", "return score + bias[h,"),),
        "lazy FlexAttention path: distance bias added instead of subtracted (eq. 3)",
        LAZY,
        "tests/attention/lazy/test_flex.py::test_two_pass_flex_composition_equals_the_reference[37-train-negative]",
    ),
    Mutation(
        "lazy-threshold-n-offset",
        "model/attention/lazy/naive.py",
        (("n = (q_pos + 1).to(p.dtype)", "n = (q_pos + 2).to(p.dtype)"),),
        "lazy reference: Elastic-Softmax threshold tau / (i + 2) instead of tau / n_i (eq. 5)",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_default_config_is_elastic_softmax_with_tau_over_n_eq5[reference]",
    ),
    Mutation(
        "lazy-flex-threshold-n-offset",
        "model/attention/lazy/flex.py",
        (("/ (q_pos[qi] + 1).to(score.dtype)", "/ (q_pos[qi] + 2).to(score.dtype)"),),
        "lazy FlexAttention path: threshold tau / (i + 2) instead of tau / n_i (eq. 5)",
        LAZY,
        "tests/attention/lazy/test_flex.py::test_two_pass_flex_composition_equals_the_reference[37-train-negative]",
    ),
    Mutation(
        "lazy-alibi-slope",
        "model/attention/lazy/config.py",
        (("2.0 ** (-8.0 * (h + 1) / n_heads)", "2.0 ** (-8.0 * h / n_heads)"),),
        "lazy alibi init: ALiBi slopes start at 2^0 instead of 2^(-8/H)",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_alibi_init_is_alibi_attention_before_the_threshold[reference]",
    ),
    Mutation(
        "lazy-table-clamp",
        "model/attention/lazy/naive.py",
        ((".clamp(0, last)\n", ".clamp(0, last - 1)\n"),),
        "lazy reference: distances past the table read its second-to-last entry",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_distances_past_the_table_read_its_last_entry[reference]",
    ),
    # ---- focus --------------------------------------------------------------------------------------------------
    Mutation(
        "focus-tau-multiplies",
        "model/attention/focus/module.py",
        (
            (
                "return (projected.to(dtype) @ centroids.to(dtype).T) / tau",
                "return (projected.to(dtype) @ centroids.to(dtype).T) * tau",
            ),
        ),
        "focus: group scores multiplied by tau instead of divided (eq. 2)",
        FOCUS,
        "tests/attention/focus/test_hard.py::test_module_prefill_chunks_and_decode_equal_full_forward[1]",
    ),
    Mutation(
        "focus-prefix-normaliser-whole-sequence",
        "model/attention/focus/sinkhorn.py",
        (("cum = logcumsumexp(log, dim=1)", "cum = torch.logsumexp(log, dim=1, keepdim=True)"),),
        "focus prefix Sinkhorn: group normaliser over the whole sequence instead of tokens <= i (leak)",
        FOCUS,
        "tests/attention/focus/test_hard.py::test_module_prefill_chunks_and_decode_equal_full_forward[1]",
    ),
    Mutation(
        "focus-sequence-sinkhorn-order",
        "model/attention/focus/sinkhorn.py",
        (
            (
                "log = log - torch.logsumexp(log, dim=1, keepdim=True)",
                "log = log - torch.logsumexp(log, dim=-1, keepdim=True)",
            ),
        ),
        "focus sequence Sinkhorn (Algorithm 1): the token normalisation replaced by a second group one",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[reference-sequence]",
    ),
    Mutation(
        "focus-gate-offset",
        "model/attention/focus/naive.py",
        (("F.logsigmoid(lam * (affinity - 0.5))", "F.logsigmoid(lam * affinity)"),),
        "focus additive gate: log sigmoid(lam g.g) without the 0.5 offset (E.4.8)",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[reference-default]",
    ),
    Mutation(
        "focus-multiplicative-gate-offset",
        "model/attention/focus/naive.py",
        (("torch.sigmoid(lam * affinity), distant", "torch.sigmoid(lam * (affinity - 0.5)), distant"),),
        "focus multiplicative gate: sigmoid(lam (g.g - 0.5)) instead of eq. 4's sigmoid(lam g.g)",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[reference-multiplicative]",
    ),
    Mutation(
        "focus-soft-window-boundary",
        "model/attention/focus/naive.py",
        (
            (
                "distant = (q_pos[:, None] - k_pos[None, :]) >= window",
                "distant = (q_pos[:, None] - k_pos[None, :]) > window",
            ),
        ),
        "focus soft: pairs at i - j = w left ungated (window boundary)",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[reference-default]",
    ),
    Mutation(
        "focus-hard-window-boundary",
        "model/attention/focus/naive.py",
        (
            (
                "local = (q_pos[:, None] - k_pos[None, :]) < window",
                "local = (q_pos[:, None] - k_pos[None, :]) <= window",
            ),
        ),
        "focus hard reference: window i - j <= w instead of < w",
        FOCUS,
        "tests/attention/focus/test_hard.py::test_cpu_path_equals_dense_reference_float32[balanced-3]",
    ),
    Mutation(
        "focus-hard-cpu-band-boundary",
        "model/attention/focus/hard/cpu.py",
        (("local = (s[None, :] > r[:, None])", "local = (s[None, :] >= r[:, None])"),),
        "focus hard CPU kernel: cross-group band i - j <= w instead of < w",
        FOCUS,
        "tests/attention/focus/test_hard.py::test_cpu_path_equals_dense_reference_float32[balanced-3]",
    ),
    Mutation(
        "focus-top-k-smallest",
        "model/attention/focus/naive.py",
        (
            (
                "descending=True, stable=True).indices[..., :top_k]",
                "descending=False, stable=True).indices[..., :top_k]",
            ),
        ),
        "focus hard: a token's k *least* likely groups as its memberships (top-k, k >= 2)",
        FOCUS,
        "tests/attention/focus/test_hard.py::test_module_prefill_chunks_and_decode_equal_full_forward[2]",
    ),
    # ---- dga ----------------------------------------------------------------------------------------------------
    Mutation(
        "dga-first-member-query",
        "model/attention/dga/module.py",
        (
            (
                "q_last = ref.take_rows(q, members[..., -1] - q_base)",
                "q_last = ref.take_rows(q, members[..., 0] - q_base)",
            ),
        ),
        "dga aggregation (eq. 14) with the group's first query instead of its last",
        DGA,
        "tests/attention/dga/test_paper.py::test_dga_is_focal_plus_aggregated_groups_eq14_to_17[reference-sequence-m2]",
    ),
    Mutation(
        "dga-least-important-focal",
        "model/attention/dga/select.py",
        (("importance.topk(r, dim=-1).indices", "importance.topk(r, dim=-1, largest=False).indices"),),
        "dga: the least important keys kept focal",
        DGA,
        "tests/attention/dga/test_paper.py::test_dga_is_focal_plus_aggregated_groups_eq14_to_17[reference-sequence-m2]",
    ),
    Mutation(
        "dga-compressed-visible-early",
        "model/attention/dga/module.py",
        (("avail = (starts + 2 * c)[:, None]  # [U, 1]", "avail = (starts + c)[:, None]  # [U, 1]"),),
        "dga causal gathered path: chunk c's compression used from chunk c + 1 (while still raw) instead of c + 2",
        DGA,
        "tests/attention/dga/test_cpu.py::test_parts_form_equals_the_dense_reference[dtype0-causal-m2-g0.2-37-gathered]",
    ),
    Mutation(
        "dga-focal-count-floor",
        "model/attention/dga/config.py",
        (("math.ceil(round(gamma * n, 9))", "math.floor(round(gamma * n, 9))"),),
        "dga focal count: floor(gamma n) instead of ceil (section 5.1)",
        DGA,
        "tests/attention/dga/test_paper.py::test_dga_is_focal_plus_aggregated_groups_eq14_to_17[reference-causal-m3-remainder]",
    ),
    # ---- prescored_hyper ----------------------------------------------------------------------------------------
    Mutation(
        "hyper-leverage-is-norm",
        "model/attention/prescored_hyper/scoring.py",
        (("return (kg * k).sum(-1)", "return (k * k).sum(-1)"),),
        "prescored_hyper leverage scoring: squared norms instead of the hat matrix's diagonal",
        HYPER,
        "tests/attention/prescored_hyper/test_paper.py::test_leverage_scoring_keeps_the_top_leverage_keys[reference]",
    ),
    Mutation(
        "hyper-keeps-lowest-scores",
        "model/attention/prescored_hyper/module.py",
        (
            (
                "self.key_scores(k, dense=dense).topk(keep, dim=-1)",
                "self.key_scores(k, dense=dense).topk(keep, dim=-1, largest=False)",
            ),
        ),
        "prescored_hyper: the lowest-scored keys kept (Algorithm 1)",
        HYPER,
        "tests/attention/prescored_hyper/test_paper.py::test_leverage_scoring_keeps_the_top_leverage_keys[reference]",
    ),
    Mutation(
        "hyper-no-fallback",
        "model/attention/prescored_hyper/module.py",
        (("or keep < self.cfg.min_keys:", "or keep < 0:"),),
        "prescored_hyper: no fallback to plain HyperAttention when fewer than min_keys survive",
        HYPER,
        "tests/attention/prescored_hyper/test_paper.py::test_too_few_survivors_fall_back_to_plain_hyperattention[reference]",
    ),
    Mutation(
        "hyper-exact-block-boundary",
        "model/attention/prescored_hyper/plan.py",
        (("if qe - qs <= cfg.min_seq_len:", "if qe - qs < cfg.min_seq_len:"),),
        "prescored_hyper: recursive halving goes one level further (exact block < instead of <= min_seq_len)",
        HYPER,
        "tests/attention/prescored_hyper/test_paper.py::test_recursive_halving_is_exact_up_to_min_seq_len[reference]",
    ),
    # ---- RoPE scaling -------------------------------------------------------------------------------------------
    Mutation(
        "rope-ntk-exponent",
        "model/rope.py",
        (("theta * factor ** (d / (d - 2))", "theta * factor ** (d / (d - 1))"),),
        "RoPE NTK-aware: base x s^(d/(d-1)) instead of s^(d/(d-2))",
        ROPE,
        "tests/model/test_rope_paper.py::test_ntk_raises_the_base_by_s_to_d_over_d_minus_2[2.0]",
    ),
    Mutation(
        "rope-dynamic-ntk-factor",
        "model/rope.py",
        (("(factor * length / l0 - (factor - 1))", "(factor * length / l0)"),),
        "RoPE dynamic NTK: s L / L0 instead of s L / L0 - (s - 1)",
        ROPE,
        "tests/model/test_rope_paper.py::test_dynamic_ntk_grows_the_factor_with_the_length[2.0]",
    ),
    Mutation(
        "rope-yarn-ramp-reversed",
        "model/rope.py",
        (("keep = 1 - ramp", "keep = ramp"),),
        "RoPE YaRN: high-frequency dimensions interpolated and low ones kept",
        ROPE,
        "tests/model/test_rope_paper.py::test_yarn_ramps_between_interpolation_and_extrapolation_eq18_to_21[4.0]",
    ),
    Mutation(
        "rope-yarn-attention-factor",
        "model/rope.py",
        (("0.1 * math.log(factor) + 1.0", "0.2 * math.log(factor) + 1.0"),),
        "RoPE YaRN: attention factor 0.2 ln s + 1 instead of 0.1 ln s + 1",
        ROPE,
        "tests/model/test_rope_paper.py::test_yarn_ramps_between_interpolation_and_extrapolation_eq18_to_21[4.0]",
    ),
    Mutation(
        "rope-llama3-band",
        "model/rope.py",
        (
            (
                "torch.where(wavelen > low_wavelen, inv / factor, inv)",
                "torch.where(wavelen < low_wavelen, inv / factor, inv)",
            ),
        ),
        "RoPE Llama 3: the short wavelengths divided by s instead of the long ones",
        ROPE,
        "tests/model/test_rope_paper.py::test_llama3_bands[1.0-4.0]",
    ),
    Mutation(
        "rope-linear-multiplies",
        "model/rope.py",
        (("return inv / factor, 1.0", "return inv * factor, 1.0"),),
        "RoPE linear (position interpolation): frequencies x s instead of / s",
        ROPE,
        "tests/model/test_rope_paper.py::test_linear_is_position_interpolation_eq4[2.0]",
    ),
    # ---- the CPU training paths (blockwise, exact): their own copies of the formulas ------------------------
    Mutation(
        "lazy-blockwise-bias-added",
        "model/attention/lazy/cpu.py",
        (("u = -table.to(dtype)[:, dist.clamp(0, self.last)]", "u = table.to(dtype)[:, dist.clamp(0, self.last)]"),),
        "lazy CPU path: distance bias added instead of subtracted (section 4)",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_learned_bias_is_subtracted_and_tau_is_per_head_eq3_eq5[auto]",
    ),
    Mutation(
        "lazy-blockwise-threshold-over-position",
        "model/attention/lazy/cpu.py",
        (("c = tau.to(dtype)[:, None] / (pos + 1)[None, :]", "c = tau.to(dtype)[:, None] / (pos + 2)[None, :]"),),
        "lazy CPU path: Elastic-Softmax threshold tau / (n + 1) instead of tau / n",
        LAZY,
        "tests/attention/lazy/test_paper.py::test_default_config_is_elastic_softmax_with_tau_over_n_eq5[auto]",
    ),
    Mutation(
        "focus-soft-cpu-gate-offset",
        "model/attention/focus/soft/cpu.py",
        (("(-0.5 * lam).expand", "(-0.25 * lam).expand"),),
        "focus soft CPU path: gate lam (g_i . g_j - 0.25) instead of - 0.5 (E.4.8)",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[auto-default]",
    ),
    Mutation(
        "focus-soft-cpu-window-boundary",
        "model/attention/focus/soft/cpu.py",
        (("self.near = (pos - keys < window) & ~self.future", "self.near = (pos - keys <= window) & ~self.future"),),
        "focus soft CPU path: the window one key wider (i - j <= w ungated)",
        FOCUS,
        "tests/attention/focus/test_paper.py::test_soft_gate_over_sinkhorn_assignments[auto-default]",
    ),
)
