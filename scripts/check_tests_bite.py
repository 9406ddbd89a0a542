"""Plant a bug, run the test that should catch it, put the code back: the tests bite.

    python scripts/check_tests_bite.py            # every planted bug
    python scripts/check_tests_bite.py -k forward  # those whose name contains "forward"

Each entry changes one piece of library code the way a plausible bug would (a text
substitution that must match exactly once), runs the named tests, and expects them to FAIL;
the same tests must pass on the unchanged code first (else a failure proves nothing). The
file is restored whatever happens. Exit status 1 if any planted bug goes unnoticed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "qkov"

# name: (file under src/qkov, text, replacement, tests that must fail)
BUGS: dict[str, tuple[str, str, str, str]] = {
    "block: shortformer positions leak into the values (the training model and the trace alike)": (
        "model/block.py",
        'v_in, _ = self.normed("attn", l, x, att.ln_w, att.ln_b)',
        'v_in, _ = self.normed("attn", l, query_key_stream(x, self.pos, self.cfg.positional), att.ln_w, att.ln_b)',
        "tests/analysis/forward/test_forward.py::test_run_equals_training_model_and_reference",
    ),
    "block: the attention scale (sqrt(d_head)) changed in the one place both passes read it": (
        "model/ops.py",
        "    return math.sqrt(d_head)",
        "    return math.sqrt(d_head) * 1.25",
        "tests/analysis/forward/test_forward.py::test_run_equals_training_model_and_reference tests/model/test_model.py::test_multihead_equals_sum_of_heads",
    ),
    "ablation study: an ablated pass started at its first layer from the stream entering the model": (
        "analysis/causal/ablation.py",
        "(start[0], start[1][i][start[0]])",
        "(start[0], start[1][i][0])",
        "tests/analysis/causal/test_ablation.py::test_the_ablated_passes_start_from_the_intact_streams_and_measure_the_same",
    ),
    "ablation sweep: a group's text and ICL passes started from the intact stream entering the layer before": (
        "analysis/causal/sweep.py",
        "torch.cat([k[layer] for k in parts])",
        "torch.cat([k[layer - 1] for k in parts])",
        "tests/analysis/causal/test_ablation.py::test_the_sweep_equals_one_study_per_head",
    ),
    "ablation sweep: the probe's passes started from the intact stream entering the layer before": (
        "analysis/causal/sweep.py",
        "    return lambda layer: streams[layer]",
        "    return lambda layer: streams[layer - 1]",
        "tests/analysis/causal/test_ablation.py::test_a_sweep_of_deeper_layers_starts_each_input_at_the_layer_and_measures_the_same",
    ),
    "ablation study: an ablated ICL pass started at its first layer from the stream entering the model": (
        "analysis/heads/probes.py",
        "(start[0], start[1][ran][start[0]])",
        "(start[0], start[1][ran][0])",
        "tests/analysis/causal/test_ablation.py::test_the_ablated_passes_start_from_the_intact_streams_and_measure_the_same",
    ),
    "ablation study: every random set mean-ablated with the study's own heads' means": (
        "analysis/causal/ablation.py",
        "        means = torch.stack([mean_of[a] for a in hs]) if mode == \"mean\" else None",
        "        means = torch.stack([mean_of[a] for a in heads]) if mode == \"mean\" else None",
        "tests/analysis/causal/test_ablation.py::test_each_random_set_of_a_mean_ablation_study_is_measured_with_its_own_means",
    ),
    "tiled loss: the blocks' log-sum-exps combined by their largest, not their log-sum-exp": (
        "analysis/forward/tiled_nll.py",
        "        nll += torch.logsumexp(lse, dim=-1)",
        "        nll += lse.amax(-1)",
        "tests/analysis/forward/test_tiled_nll.py::test_several_blocks_of_vocabulary_in_memory_and_streamed",
    ),
    "tiled loss: the unembedding's bias left out of each tile": (
        "analysis/forward/tiled_nll.py",
        "            if b_U is not None:\n                tile.add_(b_U)",
        "            if False:\n                tile.add_(b_U)",
        "tests/analysis/forward/test_tiled_nll.py::test_one_block_of_vocabulary_in_tiles_of_a_few_rows",
    ),
    "tiled loss: a tile's rows read from the first tile's targets": (
        "analysis/forward/tiled_nll.py",
        "                nll[lo : lo + rows] = logp.gather(-1, target[lo : lo + rows, None])[:, 0].neg_()",
        "                nll[lo : lo + rows] = logp.gather(-1, target[: len(logp), None])[:, 0].neg_()",
        "tests/analysis/forward/test_tiled_nll.py::test_one_block_of_vocabulary_in_tiles_of_a_few_rows",
    ),
    "tiled loss: a target's block found off by one column": (
        "analysis/forward/tiled_nll.py",
        "        here = (target >= block.start) & (target < block.stop)",
        "        here = (target > block.start) & (target <= block.stop)",
        "tests/analysis/forward/test_tiled_nll.py::test_several_blocks_of_vocabulary_in_memory_and_streamed",
    ),
    "tiled loss: an edit of the logits ignored (the final stream unembedded instead)": (
        "analysis/forward/tiled_nll.py",
        '    whole = any(a.kind == "logits" for a in',
        '    whole = any(a.kind == "no-such-kind" for a in',
        "tests/analysis/forward/test_tiled_nll.py::test_an_edit_of_the_logits_is_honoured",
    ),
    "tiled loss: the final stream asked without logits never computed": (
        "analysis/forward/tracer.py",
        "                self.normed(\"final\", None, x, unemb.ln_w, unemb.ln_b)  # the last site asked: the pass ends here",
        "                pass  # the last site asked: the pass ends here",
        "tests/analysis/forward/test_tiled_nll.py::test_the_final_stream_asked_without_logits_is_computed_and_the_pass_stops_there",
    ),
    "tiled loss: the plan still counts the logits": (
        "analysis/budget.py",
        "    if tiled:  # the final stream and its rows",
        "    if False:  # the final stream and its rows",
        "tests/analysis/forward/test_tiled_nll.py::test_the_tiled_loss_is_planned_without_the_logits",
    ),
    "narrow passes: a streamed source's entries left in the order of its blocks": (
        "analysis/forward/tracer.py",
        "        if self.streamed:  # the blocks' entries back in the order asked",
        "        if False:  # the blocks' entries back in the order asked",
        "tests/analysis/forward/test_narrow_passes.py::test_a_streamed_source_reads_the_blocks_that_hold_the_entries",
    ),
    "narrow passes: the bias of the entries taken from the first columns": (
        "analysis/forward/tracer.py",
        "parts.append(out if b_U is None else out + b_U.index_select(0, idx))",
        "parts.append(out if b_U is None else out + b_U[: len(idx)])",
        "tests/analysis/forward/test_narrow_passes.py::test_logits_at_a_few_vocabulary_entries_are_those_of_the_whole_logits",
    ),
    "narrow passes: a given attention output skipped even when a site inside is read": (
        "model/block.py",
        "        if out is not None and not any(self.active(k, l) for k in ATTENTION_INSIDE):",
        "        if out is not None:",
        "tests/analysis/forward/test_narrow_passes.py::test_an_attention_output_given_outright_is_not_computed",
    ),
    "narrowed metric: the wrong answers' positions among the entries off by one": (
        "analysis/causal/metrics.py",
        "    return vocab, [torch.searchsorted(vocab.to(t.device), t) for t in given]",
        "    return vocab, [torch.searchsorted(vocab.to(t.device), t, right=True).clamp_max(len(vocab) - 1) for t in given]",
        "tests/analysis/causal/test_narrowed_metrics.py",
    ),
    "narrowed metric: the earlier positions' logits read whole while the pass's are narrowed": (
        "analysis/causal/contrast.py",
        "            early = early if narrow is None else early.index_select(-1, narrow[0].to(early.device))",
        "            early = early if narrow is None else early[..., : len(narrow[0])]",
        "tests/analysis/causal/test_narrowed_metrics.py",
    ),
    "narrow passes: a given attention output cached as given, not at the site's shape": (
        "model/block.py",
        'return self.at("attn_out", l, out.expand(*x.shape[:-1], out.shape[-1]))',
        'return self.at("attn_out", l, out)',
        "tests/analysis/forward/test_narrow_passes.py::test_an_attention_output_given_outright_is_not_computed",
    ),
    "narrowed metric: a pass that edits the logits narrowed all the same": (
        "analysis/causal/contrast.py",
        '        if edits and any(kind == "logits" for kind, _ in self._names(list(edits))):',
        '        if False and edits and any(kind == "logits" for kind, _ in self._names(list(edits))):',
        "tests/analysis/causal/test_narrowed_metrics.py::test_a_pass_that_edits_the_logits_unembeds_them_whole",
    ),
    "narrowed metric: a subclass's own value narrowed as its parent's": (
        "analysis/causal/metrics.py",
        "        if not computes_as(self, LogitDiff, \"__call__\"):",
        "        if False:",
        "tests/analysis/causal/test_narrowed_metrics.py::test_a_subclass_that_computes_its_own_value_does_not_narrow",
    ),
    "exact patching: the receivers' layer's attention without the patched heads' change": (
        "analysis/discovery/exact.py",
        '            out[k] += torch.einsum("bnpe,ned->bpd", both[0] - both[1], W_O[hs])',
        '            out[k] += 0 * torch.einsum("bnpe,ned->bpd", both[0] - both[1], W_O[hs])',
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge",
    ),
    "exact patching: a patched key read by the first query head of its group alone": (
        "analysis/discovery/exact.py",
        '    heads_of = lambda kind, slot: [slot] if kind == "q" else list(range(slot * group, (slot + 1) * group))',
        '    heads_of = lambda kind, slot: [slot] if kind == "q" else [slot * group]',
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge",
    ),
    "exact patching: the patched keys without the positions before the shared prefix": (
        "analysis/discovery/exact.py",
        "    whole = lambda i, g, now: now if past is None else torch.cat([past[i][l][:, :, g], now], 1)  # noqa: E731",
        "    whole = lambda i, g, now: now if past is None else torch.cat([now[:, :1].expand(-1, past[i].shape[2], -1), now], 1)  # noqa: E731",
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge",
    ),
    "atomic writes: the writer's temporary lies beside the target, not in a folder of its own": (
        "io/atomic.py",
        "    tmp = os.path.join(folder, path.name)",
        "    tmp = os.path.join(os.path.dirname(folder), path.name + '.part')",
        "tests/io/test_atomic.py::test_a_write_leaves_only_its_target "
        "tests/io/test_atomic.py::test_a_kill_inside_the_writer_leaves_one_folder_that_cleanup_removes_whole",
    ),
    "edits: a function's replacement is ignored": (
        "analysis/forward/edits.py",
        "    if out is None:\n        return value",
        "    if out is not value:\n        return value",
        "tests/analysis/forward/test_forward.py::test_frozen_recording_with_own_outputs_is_the_model_and_is_linear",
    ),
    "term importance: every run adds the live outputs (no paper procedure)": (
        "analysis/paths/importance.py",
        "            x = x + prev[l] + fixed[l]",
        "            x = x + live[l] + fixed[l]",
        "tests/analysis/paths/test_paths.py::test_term_importance_against_an_independent_recomputation",
    ),
    "term effects: half the term removed": (
        "analysis/paths/effects.py",
        "            return torch.sub(full, tl, out=tl), size",
        "            return torch.sub(full, 0.5 * tl), size",
        "tests/analysis/paths/test_paths.py::test_term_effects_match_a_recomputed_loss",
    ),
    "weights: 'scale' (rotated) view centres the stream": (
        "model/ops.py",
        'out = (x if kind in ("scale", "rmsnorm") else centre(x)) / s',
        "out = centre(x) / s",
        "tests/weights/test_weights.py::test_analysis_forward_runs_every_view",
    ),
    "weights: to() takes only (device, dtype) keywords": (
        "weights/view.py",
        "changes[f.name] = v.to(*args, **kwargs)",
        "changes[f.name] = v.to(device=args[0] if args else None)",
        "tests/weights/test_weights.py::test_to_moves_and_casts_like_a_tensor",
    ),
    "public API: load_any not exported": (
        "__init__.py",
        '    "load_any",\n',
        "",
        "tests/model/test_model.py::test_public_api_is_what_the_package_docs_list",
    ),
    "corpus: validation files also train": (
        "training/data.py",
        "train = [t for rel, t in texts if not is_val_file(rel, val_fraction)]",
        "train = [t for rel, t in texts]",
        "tests/training/test_data.py::test_split_by_file_puts_each_file_whole_on_one_side",
    ),
    "lazy CLI: the memory-mapped path excludes the wrong start token": (
        "apps/cli/weights_cmds.py",
        "return ck, tokenizer, ck.bos_token_id",
        "return ck, tokenizer, ck.bos_token_id + 1",
        "tests/weights/test_lazy.py::test_cli_lazy_matches_in_memory",
    ),
    "composition baseline: divided by the writer's norm twice": (
        "analysis/circuits/composition.py",
        "scores.append(num / (writer.norm() * reader.norm()))",
        "scores.append(num / (writer.norm() * writer.norm()))",
        "tests/weights/test_lazy.py::test_composition_baseline_draws_in_blocks_with_the_same_values",
    ),
    "probe: attends to the earlier copy itself, not the token after it": (
        "analysis/heads/probes.py",
        "k = q - period + 1",
        "k = q - period",
        "tests/analysis/heads/test_heads.py::test_training_probe_finds_the_induction_head",
    ),
    "report schema: heads columns lost on reading": (
        "apps/report/sections.py",
        'd.get("columns", [])',
        "[]",
        "tests/apps/test_report.py::test_report_numbers_match_independent_computations",
    ),
    "claims: the ICL claim's threshold has the wrong sign": (
        "apps/claims.py",
        "s2 <= s1 - ICL_GAP",
        "s2 <= s1 + ICL_GAP",
        "tests/apps/test_report.py::test_claims_verdicts_follow_the_numbers",
    ),
    "bigrams: the left-out tokens (the start token's column) stay among the columns": (
        "analysis/circuits/trigrams.py",
        "max_bytes=max_bytes, rows=ids, cols=ids)",
        "max_bytes=max_bytes, rows=ids)",
        "tests/analysis/circuits/test_trigrams.py::test_bigrams_fill_the_table_when_the_start_token_dominates",
    ),
    "positional fraction: positions centred in a rotated view": (
        "analysis/heads/pattern_scores.py",
        "p = read(source.pos()[:T].expand(B, T, -1), source.norm, scale)",
        'p = read(source.pos()[:T].expand(B, T, -1), "folded", scale)',
        "tests/analysis/heads/test_heads.py::test_positional_fraction_is_unchanged_by_a_rotation_of_the_stream",
    ),
    "positional fraction: the forward's scores read without their divisor": (
        "analysis/heads/pattern_scores.py",
        "divisor = score_divisor(att.W_Q.shape[-1]) ** 2",
        "divisor = score_divisor(att.W_Q.shape[-1])",
        "tests/analysis/heads/test_heads.py::test_positional_fraction_is_its_definition_on_a_recording_and_on_a_live_pass",
    ),
    "positional fraction: the centred scores keep the keys after the query": (
        "analysis/heads/pattern_scores.py",
        "vector_norm(s.tril_(), dim=-1)",
        "vector_norm(s, dim=-1)",
        "tests/analysis/heads/test_heads.py::test_positional_fraction_is_its_definition_on_a_recording_and_on_a_live_pass",
    ),
    "value-weighted sink: the column sums include query 0": (
        "analysis/heads/pattern_scores.py",
        "(P[..., 1:, :].sum(-2).double() * norms)",
        "(P.sum(-2).double() * norms)",
        "tests/analysis/heads/test_scale.py::test_text_scores_streamed_by_layer_and_chunk_equal_the_whole_pattern_definitions",
    ),
    "value-weighted sink: value norms through W_O^T W_O instead of W_O W_O^T": (
        "analysis/heads/pattern_scores.py",
        "self.grams[layer] = W_O @ W_O.transpose(-1, -2)",
        "self.grams[layer] = (W_O.transpose(-1, -2) @ W_O)[..., : W_O.shape[1], : W_O.shape[1]]",
        "tests/analysis/heads/test_scale.py::test_text_scores_streamed_by_layer_and_chunk_equal_the_whole_pattern_definitions",
    ),
    "rounded_array: a near-tie of the scaled value trusted to np.rint": (
        "finite.py",
        "ok = (np.abs(d) <= 22) & (np.abs(np.abs(m - r) - 0.5) > 1e-6)",
        "ok = np.abs(d) <= 22",
        "tests/test_finite.py::test_rounded_array_is_rounded_entry_for_entry",
    ),
    "rounded_array: powers of ten beyond 1e22 taken as exact": (
        "finite.py",
        "ok = (np.abs(d) <= 22) & (np.abs(np.abs(m - r) - 0.5) > 1e-6)",
        "ok = np.abs(np.abs(m - r) - 0.5) > 1e-6",
        "tests/test_finite.py::test_rounded_array_is_rounded_entry_for_entry",
    ),
    "heads: the table's run unembeds every position for an ICL curve it does not show": (
        "apps/cli/behaviour_cmds.py",
        "            icl_curve=args.json,",
        "            icl_curve=True,",
        "tests/analysis/heads/test_icl.py::test_the_heads_table_asks_no_curve_and_prints_the_jsons_score",
    ),
    "heads: icl_curve not handed to the ICL score": (
        "analysis/heads/report.py",
        "icl_score(source, icl_on, progress=progress, curve=icl_curve)",
        "icl_score(source, icl_on, progress=progress, curve=True)",
        "tests/analysis/heads/test_icl.py::test_the_heads_table_asks_no_curve_and_prints_the_jsons_score",
    ),
    "virtual weights: shortformer positions allowed to reach the values": (
        "analysis/circuits/qk_ov.py",
        'if wk == "pos" and rk not in ("q", "k") and source.cfg.positional == "shortformer":',
        "if False:",
        "tests/analysis/circuits/test_circuits.py::test_virtual_weights",
    ),
    "ties: a tie with the own logit counts as in the top k": (
        "analysis/circuits/factored.py",
        "out.append((block >= d[..., None]).sum(-1) - 1)",
        "out.append((block > d[..., None]).sum(-1))",
        "tests/analysis/circuits/test_circuits.py::test_diag_rank_counts_ties_against_the_diagonal_in_both_paths",
    ),
    "positional fraction: the variance over keys in one pass (mean of squares less the squared mean)": (
        "analysis/heads/pattern_scores.py",
        "        s -= s.sum(-1, keepdim=True) / counts[:, None]\n        return (torch.linalg.vector_norm(s.tril_(), dim=-1).square_() / counts)[1:]",
        "        return (s.pow(2).sum(-1) / counts - (s.sum(-1) / counts).pow(2)).clamp_min(0)[1:]",
        "tests/analysis/heads/test_heads.py::test_positional_fraction_keeps_its_digits_when_scores_share_a_large_offset",
    ),
    "composition baseline: the first pass skips one uniform too many per tensor": (
        "analysis/circuits/composition.py",
        "        torch.empty(numel, dtype=torch.float64).uniform_(generator=g)",
        "        torch.empty(numel + 16, dtype=torch.float64).uniform_(generator=g)",
        "tests/weights/test_lazy.py::test_composition_baseline_draws_in_blocks_with_the_same_values",
    ),
    "composition baseline: no check of where the draws end": (
        "analysis/circuits/composition.py",
        "    if not torch.equal(g.get_state(), end):",
        "    if False:",
        "tests/weights/test_lazy.py::test_composition_baseline_refuses_a_generator_that_skips_unlike_its_normals",
    ),
    "screens: bfloat16 wherever the CPU has it, faster or not": (
        "analysis/circuits/bounded.py",
        "device.type == \"cpu\" and _bf16_faster() else dtype",
        "device.type == \"cpu\" and _bf16_cpu() else dtype",
        "tests/analysis/circuits/test_bounded.py::test_the_screen_is_bfloat16_only_where_it_runs_faster",
    ),
    "screens: a CPU without native bfloat16 timed anyway": (
        "analysis/circuits/bounded.py",
        "    if not _bf16_cpu():\n        return False\n    g = torch.Generator()",
        "    g = torch.Generator()",
        "tests/analysis/circuits/test_bounded.py::test_the_screen_is_bfloat16_only_where_it_runs_faster",
    ),
    "term sizes: W_U W_U^T without its last block of columns": (
        "analysis/paths/effects.py",
        "    for lo in range(0, V, GRAM_COLUMNS):\n        block = W_U[:, lo : lo + GRAM_COLUMNS].double()",
        "    for lo in range(0, V - GRAM_COLUMNS, GRAM_COLUMNS):\n        block = W_U[:, lo : lo + GRAM_COLUMNS].double()",
        "tests/analysis/paths/test_paths_fast.py::test_gram_in_column_blocks_equals_the_float64_product",
    ),
    "term sizes: the Gram matrices of the layer before the term's": (
        "analysis/paths/effects.py",
        "            self.gram, self.layer = _gram(R, self.UU), key[-2]",
        "            self.gram, self.layer = _gram(head_read(self.source, max(0, key[-2] - 1)), self.UU), key[-2]",
        "tests/analysis/paths/test_paths_fast.py::test_shared_head_unembedding_gives_each_terms_own_logits",
    ),
    "own logit in the top k: a near tie decided as out": (
        "analysis/circuits/factored.py",
        "                inside[i] = int((row >= row[cols[i]]).sum()) - 1 < k",
        "                inside[i] = False",
        "tests/analysis/circuits/test_factored.py::test_diag_in_top_ties_and_near_ties",
    ),
    "own logit in the top k: a near tie decided as in": (
        "analysis/circuits/factored.py",
        "                inside[i] = int((row >= row[cols[i]]).sum()) - 1 < k",
        "                inside[i] = True",
        "tests/analysis/circuits/test_factored.py::test_diag_in_top_ties_and_near_ties",
    ),
    "own logit in the top k: no rounding margin (float32 values decide near ties)": (
        "analysis/circuits/factored.py",
        "        margin = 2 * (gamma * A.double().norm(dim=-1) * col_max + u * d.abs())",
        "        margin = 0 * d",
        "tests/analysis/circuits/test_factored.py::test_diag_in_top_ties_and_near_ties",
    ),
    "own logit in the top k: the screen counts entries that may be below the diagonal": (
        "analysis/circuits/factored.py",
        "                torch.gt(v, above[lo:hi, None], out=sflags[: hi - lo])",
        "                torch.ge(v, maybe[lo:hi, None], out=sflags[: hi - lo])",
        "tests/analysis/circuits/test_factored.py::test_diag_in_top_equals_the_dense_answer",
    ),
    "own logit in the top k: the rows the screen kept read from the first one on": (
        "analysis/circuits/factored.py",
        "            idx = rest[lo : lo + step]",
        "            idx = torch.arange(lo, min(m, lo + step), device=A.device)[: len(rest[lo : lo + step])]",
        "tests/analysis/circuits/test_factored.py::test_diag_in_top_equals_the_dense_answer",
    ),
    "copying scores: a block of logit rows skipped (the last one)": (
        "analysis/heads/repeated.py",
        "    for lo in range(0, B * Q, work.shape[1]):",
        "    for lo in range(0, B * Q - work.shape[1], work.shape[1]):",
        "tests/analysis/heads/test_scale.py::test_the_fast_copying_scores_equal_their_definition_with_repeated_attended_tokens",
    ),
    "copying scores: heads read out by the wrong head of their group": (
        "analysis/circuits/copying.py",
        "            OU = OUs[i % group] if reads_out else None",
        "            OU = OUs[0] if reads_out else None",
        "tests/analysis/circuits/test_circuits.py::test_copying_scores_read_heads_out_in_groups",
    ),
    "ties: a tie with the own logit counts as in the top k (one-matrix path)": (
        "analysis/circuits/factored.py",
        "            torch.ge(block, d[:, None], out=above[: hi - lo])",
        "            torch.gt(block, d[:, None], out=above[: hi - lo])",
        "tests/analysis/circuits/test_factored.py::test_diag_rank",
    ),
    "bound and refine: the screen's rounding left out of the row bounds": (
        "analysis/circuits/bounded.py",
        "out[lo:hi] = _column_max(S) + delta * a_norm * b_max + tiny",
        "out[lo:hi] = _column_max(S) + tiny",
        "tests/analysis/circuits/test_bounded.py::test_row_bounds_cover_every_evaluation_of_every_row_and_stay_close "
        "tests/analysis/circuits/test_bounded.py::test_top_entries_equal_the_dense_top_on_adversarial_factors",
    ),
    "bound and refine: a row of negative entries bounded by its most negative entry": (
        "analysis/circuits/bounded.py",
        "    if negative.numel():",
        "    if False:",
        "tests/analysis/circuits/test_bounded.py::test_row_bounds_cover_every_evaluation_of_every_row_and_stay_close",
    ),
    "bound and refine: every row computed exactly (the bounds unused)": (
        "analysis/circuits/bounded.py",
        "rows = rows[bound[rows] >= float(best_v[-1])]",
        "rows = rows[bound[rows] >= -float('inf')]",
        "tests/analysis/circuits/test_bounded.py::test_the_refine_computes_few_rows",
    ),
    "stable top-k: equal values straddling the k-th place left to torch.topk": (
        "analysis/circuits/bounded.py",
        "    if cut.numel():",
        "    if False:",
        "tests/analysis/circuits/test_bounded.py::test_stable_topk_is_the_stable_sort "
        "tests/analysis/circuits/test_bounded.py::test_top_entries_equal_the_dense_sort_on_ties",
    ),
    "trigrams: equal scores in the order the search visited them": (
        "analysis/circuits/trigrams.py",
        "best = sorted(best + _source_best(qk.rows(srcs), ov.rows(srcs), srcs, excl, k, top))[:top]",
        "best = sorted(best + _source_best(qk.rows(srcs), ov.rows(srcs), srcs, excl, k, top), key=lambda t: t[0])[:top]",
        "tests/analysis/circuits/test_trigrams.py::test_tied_trigrams_come_by_source_destination_output_whatever_the_visit",
    ),
    "roles: induction on a positive eigenvalue score (the old criterion)": (
        "analysis/heads/report.py",
        'and scores["copying_rank"][l, h] > thresholds["induction_copying"]',
        'and scores["eigen_copying"][l, h] > 0',
        "tests/analysis/heads/test_heads.py::test_induction_needs_attention_and_copying",
    ),
    "rank copying: ties count against the attended token": (
        "analysis/heads/repeated.py",
        "percentile = (below + 0.5 * tied) / (logits.shape[-1] - 1)",
        "percentile = below / (logits.shape[-1] - 1)",
        "tests/analysis/heads/test_heads.py::test_rank_copying_of_a_silent_head_is_chance",
    ),
    "default view: the unembedding not centred": (
        "weights/view.py",
        "        center_unembed: bool = True,",
        "        center_unembed: bool = False,",
        "tests/io/test_interop_tl.py::test_circuit_scores_of_an_imported_model_equal_transformerlens",
    ),
    "default view: writers of a LayerNorm-free model centred silently": (
        "weights/parts.py",
        "    if center_writing and not layernorm:",
        "    if False:",
        "tests/weights/test_weights.py::test_default_view_is_transformerlens_processed_and_refuses_centring_without_layernorm",
    ),
    "lazy: the embedding not centred like the in-memory view": (
        "weights/lazy.py",
        'return self._writer(self._get("W_E", rows))',
        'return self._get("W_E", rows)',
        "tests/weights/test_lazy.py::test_layers_fold_exactly_as_the_whole_model",
    ),
    "inputs: a model without text refused (no random-token fallback)": (
        "apps/inputs.py",
        "    seqs = random_tokens(",
        '    raise QkovError("no text")\n    seqs = random_tokens(',
        "tests/weights/test_no_tokenizer.py",
    ),
    "qk expansion: a pair's key taken from the query head": (
        "analysis/paths/qk_side.py",
        "return (self.q_heads[i] @ self.k_heads[j].transpose(-1, -2))",
        "return (self.q_heads[i] @ self.k_heads[i].transpose(-1, -2))",
        "tests/analysis/paths/test_paths.py::test_expand_qk_sums_to_real_scores",
    ),
    "trigrams: no note for a head beyond layer 0": (
        "apps/cli/weights_cmds.py",
        '    if layer > 0:\n        data["note"]',
        '    if False:\n        data["note"]',
        "tests/weights/test_lazy.py::test_cli_lazy_matches_in_memory",
    ),
    "claims: the ICL rule does not say it is looser": (
        "apps/claims.py",
        'f"the 2-layer score at least {ICL_GAP:g} nats below the 1-layer one; looser than the paper\'s "',
        'f"the 2-layer score at least {ICL_GAP:g} nats below the 1-layer one; than the paper\'s "',
        "tests/apps/test_report.py::test_claims_verdicts_follow_the_numbers",
    ),
    "layout: an analysis module imports the report": (
        "analysis/heads/report.py",
        "from ...errors import QkovError\n",
        "from ...errors import QkovError\nfrom ...apps.report import sections as _unused  # noqa: F401\n",
        "tests/test_layout.py::test_dependencies_point_one_way",
    ),
    "virtual heads: the bound forgets the reader's normalisation": (
        "analysis/paths/virtual.py",
        "col = col / scale[..., 0].double().pow(2)[:, None]",
        "col = col",
        "tests/analysis/heads/test_scale.py::test_virtual_heads_beyond_the_budget_are_chosen_by_a_bound_that_holds",
    ),
    "virtual heads: the coverage counts only the kept terms": (
        "analysis/paths/virtual.py",
        "            total += z.sum(2) @ att.W_O[h2]\n",
        "            total += z[:, :, :1].sum(2) @ att.W_O[h2]\n",
        "tests/analysis/heads/test_scale.py::test_virtual_heads_beyond_the_budget_are_chosen_by_a_bound_that_holds",
    ),
    "text scores: the last chunk is not counted": (
        "analysis/heads/pattern_scores.py",
        "    for got in sp.gather(parts, len(bounds)):",
        "    for got in sp.gather(parts, len(bounds))[: len(bounds) - 1]:",
        "tests/analysis/heads/test_scale.py::test_text_scores_streamed_by_layer_and_chunk_equal_the_whole_pattern_definitions",
    ),
    "report: the paths section runs the text again instead of reading the report's one recorded run": (
        "apps/report/collect.py",
        "        paths = _paths(w, text_ids[:batch], top, recording)",
        "        paths = _paths(w, text_ids[:batch], top)",
        "tests/apps/test_report.py::test_report_runs_its_text_once_and_each_section_equals_its_own_run",
    ),
    "text scores: a recording's positional score read without the query/key divisor": (
        "analysis/heads/pattern_scores.py",
        '            self.callback(self.view(l, recording["pattern", l], got("v"), got("qk_in"), got(self.scale)))',
        '            self.callback(self.view(l, recording["pattern", l], got("v"), got("qk_in"), None))',
        "tests/analysis/heads/test_scale.py::test_text_scores_read_the_leading_sequences_from_a_recording",
    ),
    "runs: a directory without a manifest counts as a restartable run": (
        "training/rundir.py",
        "        return _legacy_kind(path)\n",
        '        return "restartable"\n',
        "tests/training/test_runs.py::test_a_directory_that_is_not_a_run_is_never_overwritten",
    ),
    "runs: a name is recorded over a file qkov did not write": (
        "io/manifest.py",
        "    taken = [n for n in new if occupied(folder, n)]\n",
        "    taken: list[str] = []\n",
        "tests/training/test_rundir.py::test_a_users_file_inside_a_run_is_kept_and_never_replaced",
    ),
    "runs: the log is not kept in the training state": (
        "training/loop.py",
        '            "metrics": self.metrics,',
        '            "metrics_old": self.metrics,',
        "tests/training/test_runs.py::test_a_state_without_config_json_resumes_and_a_run_without_state_restarts",
    ),
    "sites: attn_out forgets b_O when heads write one by one": (
        "model/block.py",
        "out = per_head.sum(2) if att.b_O is None else per_head.sum(2) + att.b_O",
        "out = per_head.sum(2)",
        "tests/analysis/forward/test_sites.py::test_every_site_is_cached_in_its_layout_and_equals_its_definition",
    ),
    "sites: the per-head query/key copies miss the shortformer positions": (
        "model/block.py",
        '        if kind != "v":\n            split = query_key_stream(',
        '        if False:\n            split = query_key_stream(',
        "tests/analysis/forward/test_sites.py::test_every_site_is_cached_in_its_layout_and_equals_its_definition",
    ),
    "sites: TransformerLens' hook_rot_k read as the queries": (
        "analysis/forward/sites.py",
        '    "rot_k": "k",\n',
        '    "rot_k": "q",\n',
        "tests/analysis/causal/test_patching_tl.py::test_transformerlens_short_names_resolve_as_transformerlens_resolves_them",
    ),
    "sites: a wildcard glob takes the per-head input copies": (
        "analysis/forward/sites.py",
        '            skip_copies = kind_part not in COPIES  # a wildcard kind never takes the readers\' copies',
        '            skip_copies = False',
        "tests/analysis/forward/test_sites.py::test_every_site_is_cached_in_its_layout_and_equals_its_definition",
    ),
    "edits: a head's edit lands on head 0": (
        "analysis/forward/edits.py",
        "                value.select(dim, address.head).copy_(new)",
        "                value.select(dim, 0).copy_(new)",
        "tests/analysis/forward/test_edits.py::test_head_edits_touch_one_head_and_in_place_functions_work",
    ),
    "grad: cached activations keep no gradient": (
        "analysis/forward/tracer.py",
        "                value.retain_grad()",
        "                pass",
        "tests/analysis/forward/test_edits.py::test_gradients_equal_the_training_models_autograd",
    ),
    "decompositions: the final normalisation is not applied before the unembedding": (
        "analysis/forward/cache.py",
        "        stack = self.apply_ln() if self.layer is None and not self.normalized else self",
        "        stack = self",
        "tests/analysis/forward/test_edits.py::test_decompositions_add_up_to_the_stream_and_the_logits",
    ),
    "patching: each copy gets another copy's patch": (
        "analysis/causal/patching.py",
        "    index = [torch.arange(K), zeros]",
        "    index = [torch.arange(K).flip(0), zeros]",
        "tests/analysis/causal/test_patching.py::test_batched_sweeps_equal_one_patch_at_a_time",
    ),
    "patching: a sweep starts after the patched layer": (
        "analysis/causal/patching.py",
        "        start = min(l, c.reads_from)",
        "        start = min(l + 1, c.reads_from, L)",
        "tests/analysis/causal/test_patching.py::test_batched_sweeps_equal_one_patch_at_a_time tests/analysis/causal/test_patching_tl.py",
    ),
    "toolkit: the one swap ignores the direction (the base run is always the corrupted one)": (
        "analysis/causal/result.py",
        '    return (corrupted, clean) if direction == "denoise" else (clean, corrupted)',
        "    return (corrupted, clean)",
        "tests/analysis/causal/test_toolkit.py::test_a_contrast_records_swaps_and_measures_as_the_model_does "
        "tests/analysis/causal/test_patching.py::test_batched_sweeps_equal_one_patch_at_a_time",
    ),
    "toolkit: the one head parser reads LAYER.HEAD as HEAD.LAYER": (
        "analysis/forward/address.py",
        "        return Address(HEAD, int(m.group(1)), int(m.group(2)), inp)",
        "        return Address(HEAD, int(m.group(2)), int(m.group(1)), inp)",
        "tests/analysis/forward/test_address.py tests/analysis/causal/test_ablation.py::test_bad_heads_are_one_line_errors",
    ),
    "toolkit: a key input read at the query head's slot under grouped-query attention": (
        "analysis/forward/address.py",
        '        group = cfg.n_heads // cfg.kv_heads if self.input in ("k", "v") else 1',
        "        group = 1",
        "tests/analysis/causal/test_toolkit.py::test_path_patching_into_a_grouped_key_equals_an_edit_by_hand",
    ),
    "toolkit: a result read by label at the index before": (
        "analysis/causal/result.py",
        "                index.append(labels.index(str(key)))",
        "                index.append(labels.index(str(key)) - 1)",
        "tests/analysis/causal/test_toolkit.py::test_results_take_named_axes_of_any_kind",
    ),
    "toolkit: qkov patch makes flags of the built-in sweeps' options only": (
        "apps/cli/patch_cmds.py",
        "    for opt in study_options().values():",
        "    for opt in list(study_options().values())[:5]:",
        "tests/analysis/causal/test_plugging_in.py::test_every_surface_shows_the_registered_sweep",
    ),
    "toolkit: the study runs the built-in sweeps, not the registry": (
        "analysis/causal/studies.py",
        "    asked = [s for s in SWEEPS.values() if s.when(values)]",
        "    asked = [s for s in BUILT_IN if s.when(values)]",
        "tests/analysis/causal/test_plugging_in.py::test_every_surface_shows_the_registered_sweep",
    ),
    "toolkit: the report's heatmap takes its rows from the layer axis whatever the result's axes": (
        "apps/report/static/report.js",
        "    let y = r.labels[r.axes[0]];",
        "    let y = r.labels.layer;",
        "tests/show/test_notebooks.py::test_results_with_axes_of_any_kind_draw_in_a_browser",
    ),
    "path patching: the sender's change subtracted": (
        "analysis/causal/path_patch.py",
        "            out[:, :, :, s] = base[None] + delta",
        "            out[:, :, :, s] = base[None] - delta",
        "tests/analysis/causal/test_patching.py::test_path_patching_into_keys_and_logits_equals_a_hand_computation",
    ),
    "path patching: the change reaches the receiver's every input": (
        "analysis/causal/path_patch.py",
        '        edits[Address(f"{kind}_input", l2)] = _receive(',
        '        edits[Address("v_input" if kind == "k" else f"{kind}_input", l2)] = _receive(',
        "tests/analysis/causal/test_patching.py::test_the_induction_heads_key_path_carries_its_prefix_matching",
    ),
    "path patching: each input's copy carries every input's change": (
        "analysis/causal/path_patch.py",
        "        only[k] = 1  # copy k carries the change into this input; the others keep the base input",
        "        only[:] = 1",
        "tests/apps/test_report.py::test_report_on_a_hand_built_model_names_its_circuit",
    ),
    "attribution: the difference taken the wrong way round": (
        "analysis/causal/patching.py",
        "        effect = (src_recording[(kind, l)] - a.detach()) * grad",
        "        effect = (a.detach() - src_recording[(kind, l)]) * grad",
        "tests/analysis/causal/test_patching.py::test_attribution_is_the_first_order_term_of_the_patch",
    ),
    "metrics: the logit difference read at the first position": (
        "analysis/causal/metrics.py",
        "        logits = out.logits_at(self.position)  # [B, V]",
        "        logits = out.logits_at(0)  # [B, V]",
        "tests/analysis/causal/test_patching_tl.py::test_patching_sweeps_equal_transformerlens_patching",
    ),
    "ablation: resampling keeps each sequence's own output": (
        "analysis/causal/ablation.py",
        "            new = z[derangement(z.shape[0], seed).to(z.device)]",
        "            new = z",
        "tests/analysis/causal/test_ablation.py::test_resample_ablation_takes_the_output_another_sequence_gave",
    ),
    "ablation: positions ignored": (
        "analysis/causal/ablation.py",
        "        out[:, at] = new[:, at]",
        "        out = new",
        "tests/analysis/causal/test_ablation.py::test_ablation_at_positions_changes_only_those_positions_onwards",
    ),
    "causal composition: the paths denoised instead of noised": (
        "analysis/causal/composition.py",
        "got, base, target = input_paths(source, clean, corrupted, sender=writer, receiver=reader, metric=m)",
        'got, base, target = input_paths(source, clean, corrupted, sender=writer, receiver=reader, metric=m, direction="denoise")',
        "tests/apps/test_report.py::test_report_on_a_hand_built_model_names_its_circuit",
    ),
    "claims: the causal claim ignores the value path": (
        "apps/claims.py",
        'p["k"] >= K_PATH_MOST and p["q"] <= OTHER_PATH_LITTLE and p["v"] <= OTHER_PATH_LITTLE',
        'p["k"] >= K_PATH_MOST and p["q"] <= OTHER_PATH_LITTLE',
        "tests/apps/test_report.py::test_claims_verdicts_follow_the_numbers",
    ),
    "circuit claim: the key edge's rank read from the logits edge": (
        "apps/claims.py",
        "            ranks = [rank.get(key), rank.get(out)]",
        "            ranks = [rank.get(out), rank.get(out)]",
        "tests/apps/test_report.py::test_report_on_a_hand_built_model_names_its_circuit "
        "tests/apps/test_report.py::test_circuit_claim_follows_its_rule",
    ),
    "circuit claim: the circuit found not consulted": (
        "apps/claims.py",
        "for r in ranks) and key in kept and out in kept",
        "for r in ranks)",
        "tests/apps/test_report.py::test_circuit_claim_follows_its_rule",
    ),
    "report circuit: the largest circuit reaching the target instead of the smallest": (
        "apps/report/discovery.py",
        "    i = reach[0] if reach else len(f) - 1",
        "    i = reach[-1] if reach else len(f) - 1",
        "tests/apps/test_report.py::test_report_circuit_section_finds_the_induction_circuit_and_is_the_librarys",
    ),
    "report circuit: the exact column copies EAP's": (
        "apps/report/discovery.py",
        "rounded(exact.at_edge(name), DIGITS)",
        "rounded(scores.at_edge(name), DIGITS)",
        "tests/apps/test_report.py::test_report_circuit_section_finds_the_induction_circuit_and_is_the_librarys",
    ),
    "circuit layout: edge width by the signed score": (
        "analysis/discovery/layout.py",
        '"width": round(0.5 + 4.5 * abs(sc) / top, 2)',
        '"width": round(0.5 + 4.5 * sc / top, 2)',
        "tests/apps/test_report.py::test_report_circuit_section_finds_the_induction_circuit_and_is_the_librarys",
    ),
    "explorer circuit_edge: the edge's neighbour patched": (
        "apps/explore/views_circuit.py",
        'exact = edge_scores(ex.weights, task, method="exact", edges=[number], progress=progress)',
        'exact = edge_scores(ex.weights, task, method="exact", edges=[max(0, number - 1)], progress=progress)',
        "tests/apps/test_explore_views.py::test_circuit_views_are_the_report_section_and_exact_patching",
    ),
    "patch CLI: the corrupted input read as the clean one": (
        "apps/inputs.py",
        "    a, b = read_sequences(clean, model), read_sequences(corrupted, model)",
        "    a, b = read_sequences(clean, model), read_sequences(clean, model)",
        "tests/apps/test_patch_cli.py::test_patch_prints_the_librarys_numbers_for_texts_and_token_ids",
    ),
    "loading: a view read from the memory map skips the MLPs": (
        "weights/view.py",
        "            if mlp is not None:\n                parts |=",
        "            if False:\n                parts |=",
        "tests/weights/test_lazy.py::test_a_view_read_from_the_memory_map_is_the_loaded_models",
    ),
    "ablation mean: the last, shorter chunk of the sample left out": (
        "analysis/causal/ablation.py",
        "    for lo in range(0, tokens.shape[0], chunk):\n        trace(source, tokens[lo : lo + chunk]",
        "    for lo in range(0, tokens.shape[0] - chunk + 1, chunk):\n        trace(source, tokens[lo : lo + chunk]",
        "tests/analysis/causal/test_ablation.py::test_mean_ablation_equals_independent_forwards",
    ),
    "ablation mean: every head's mean z is its layer's first head's": (
        "analysis/causal/ablation.py",
        "            total[rows] += z.index_select(2, cols).double().sum(dim=(0, 1))",
        "            total[rows] += z[:, :, :1].double().sum(dim=(0, 1))",
        "tests/analysis/causal/test_ablation.py::test_mean_ablation_equals_independent_forwards",
    ),
    "ICL score: the late window ends one position before the late token": (
        "analysis/heads/probes.py",
        "torch.arange(max(0, late - window + 1), late + 1)",
        "torch.arange(max(0, late - window), late)",
        "tests/analysis/heads/test_heads.py::test_detectors_name_exactly_the_designed_heads",
    ),
    "induction score: the repeated block read as starting at position 0 (no start token)": (
        "analysis/heads/probes.py",
        "def induction_entries(seq: int, period: int, *, first: int = 1) -> tuple[Tensor, Tensor]:",
        "def induction_entries(seq: int, period: int, *, first: int = 0) -> tuple[Tensor, Tensor]:",
        "tests/apps/test_dynamics.py::test_the_window_is_where_the_circuit_was_built_and_a_flat_series_has_none",
    ),
    "composition: K-composition reads the key side through the key's own Gram matrix": (
        "analysis/circuits/composition.py",
        "S = gram_sqrt(GQ).transpose(-1, -2)  # K: A = W_K R^T, B = W_Q^T",
        "S = gram_sqrt(GK).transpose(-1, -2)  # K: A = W_K R^T, B = W_Q^T",
        "tests/apps/test_report.py::test_report_numbers_match_independent_computations",
    ),
    "eigenvalues: the copying score divides by the real parts' sizes, not the moduli": (
        "analysis/circuits/copying.py",
        "    return eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1).clamp_min(1e-30)",
        "    return eigenvalues.sum(-1).real / eigenvalues.real.abs().sum(-1).clamp_min(1e-30)",
        "tests/apps/test_report.py::test_report_numbers_match_independent_computations",
    ),
    "bigrams: a token and the token after it swapped": (
        "analysis/circuits/trigrams.py",
        "entries = zip(res.values.tolist(), res.rows.tolist(), res.cols.tolist())",
        "entries = zip(res.values.tolist(), res.cols.tolist(), res.rows.tolist())",
        "tests/apps/test_report.py::test_zero_layer_report_renders",
    ),
    "texts: the tokenizer's own start token kept, so a Llama text gets two": (
        "model/tokens.py",
        "ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)",
        "ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids)",
        "tests/model/test_real_tokenizers.py::test_to_tokens_is_the_directorys_own_tokenizer",
    ),
    "metric words: only the spelling as typed is tried": (
        "model/tokens.py",
        'for spelling in dict.fromkeys([word, " " + bare, bare]):',
        "for spelling in [word]:",
        "tests/model/test_real_tokenizers.py::test_words_resolve_to_one_token",
    ),
    "ordinary tokens: byte-fallback pieces kept in the tables and probes": (
        "model/tokens.py",
        "byte = {i for i in codec.byte_ids() if i < d_vocab}",
        "byte = set()",
        "tests/model/test_real_tokenizers.py::test_tables_and_probes_leave_byte_and_special_tokens_out",
    ),
    "ablate --heads all: every copy of the batch ablates the first head of its group": (
        "analysis/causal/sweep.py",
        "def edit(z: Tensor, site: Address, lo: int = g * B, one: Callable = one) -> Tensor:",
        "def edit(z: Tensor, site: Address, lo: int = 0, one: Callable = one) -> Tensor:",
        "tests/analysis/causal/test_ablation.py::test_the_sweep_equals_one_study_per_head",
    ),
    "ablate: the probe ignores where the ablation is": (
        "analysis/causal/ablation.py",
        "return at is None or bool((at <= 2 * length - 1).any())",
        "return True",
        "tests/analysis/causal/test_ablation.py::test_the_probe_follows_the_ablated_positions",
    ),
    "run_with_hooks: a hook's replacement is dropped": (
        "analysis/forward/lens.py",
        "value = value if new is None else new",
        "value = value",
        "tests/analysis/forward/test_lens.py::test_run_with_hooks_equals_transformerlens",
    ),
    "trace: stream='model' still centres the writers": (
        "weights/convert.py",
        'return False if stream == "model" else None',
        "return None",
        "tests/weights/test_stream.py::test_stream_model_is_what_transformers_computes_and_the_default_is_it_centred",
    ),
    "logit_attrs: pos_slice=-1 reads the position before": (
        "analysis/forward/cache.py",
        "return values[:, :, pos_slice]",
        "return values[:, :, pos_slice - 1]",
        "tests/analysis/forward/test_edits.py::test_decompositions_add_up_to_the_stream_and_the_logits",
    ),
    "generate: top_k keeps one token too many": (
        "model/generate.py",
        "kth = scaled.topk(top_k, dim=-1).values[:, -1:]",
        "kth = scaled.topk(min(top_k + 1, scaled.shape[-1]), dim=-1).values[:, -1:]",
        "tests/analysis/forward/test_lens.py::test_generate_greedy_and_sampled_equal_transformerlens",
    ),
    "sites: a kind alone names layer 0 only": (
        "analysis/forward/sites.py",
        "return [Address(a.kind, l) for l in range(self.cfg.n_layers)]",
        "return [Address(a.kind, 0)]",
        "tests/analysis/forward/test_sites.py::test_a_kind_alone_is_that_kind_at_every_layer",
    ),
    "explorer graph: drawn into the panel's old element, before Panel.draw attaches the new one (blank)": (
        "apps/explore/static/explore.js",
        "const g = S.comp, box = S.compBox;",
        'const g = S.comp, box = P.composition.out.querySelector(".graph");',
        "tests/apps/test_page_fit.py::test_the_explorer_graph_is_drawn_after_compute_with_the_strongest_edges[1400]",
    ),
    "explorer graph: the threshold starts at the weakest edge above the baselines (a hairball)": (
        "apps/explore/views_graph.py",
        "return float(above[min(most, len(above)) - 1])",
        "return float(above[-1])",
        "tests/apps/test_page_fit.py::test_the_explorer_graph_is_drawn_after_compute_with_the_strongest_edges[1400]",
    ),
    "docs: a module's docstring rewritten, its API page not (scripts/docs/api_pages.py not rerun)": (
        "analysis/circuits/vocab.py",
        '"""Products with the embedding and the unembedding, in blocks',
        '"""Products of the embedding and the unembedding, in blocks',
        "tests/test_docs_site.py::test_the_api_pages_are_up_to_date",
    ),
    "finite: an infinity passes as a number (strict JSON refuses it)": (
        "finite.py",
        "    return x if math.isfinite(x) else None",
        "    return None if math.isnan(x) else x",
        "tests/test_finite.py",
    ),
    "finite: the --json output keeps a NaN": (
        "apps/cli/common.py",
        "    print(json.dumps(json_safe(data), indent=2, allow_nan=False))",
        "    print(json.dumps(data, indent=2))",
        "tests/test_finite.py::test_every_json_output_goes_through_it",
    ),
    "layout: the apps read a name its module does not declare public": (
        "io/checkpoint.py",
        '    "training_record",\n',
        "",
        "tests/test_layout.py::test_apps_and_show_read_only_public_names_of_the_layers_below",
    ),
    "training: the steps are not reported through the progress protocol": (
        "training/loop.py",
        '            tick(p.progress, "train", step, tc.steps)\n',
        "",
        "tests/training/test_train.py::test_training_lowers_loss_and_writes_a_checkpoint",
    ),
    "explorer: an empty token is taken as a token ('' == '' lets every request in)": (
        "apps/explore/server.py",
        "    if token is None:\n        return\n    if not isinstance(token, str)",
        "    if not token:\n        return\n    if not isinstance(token, str)",
        "tests/apps/test_explore_server.py::test_an_empty_blank_or_short_token_is_refused_before_serving",
    ),
    "explorer: token mode skips the Host check (a rebound DNS name with a leaked token gets in)": (
        "apps/explore/server.py",
        "            if not (is_loopback(name) or name in self.hosts or (name and name == arrived.lower())):",
        "            if False:",
        "tests/apps/test_explore_server.py::test_token_mode_refuses",
    ),
    "training: the batch order depends on the process (a salted hash), so fresh runs of one seed differ": (
        "training/data.py",
        "self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)",
        "self._perm = np.random.default_rng([self.seed, epoch, hash(str(epoch)) % 997]).permutation(self.n_windows)",
        "tests/training/test_determinism.py::test_the_same_training_in_fresh_processes_under_load_gives_the_same_bits",
    ),
    "device: exp left out of the vector-math warm-up (its first parallel call picks MKL's kernel)": (
        "device.py",
        '"erfinv", "exp", "expm1",',
        '"erfinv", "expm1",',
        "tests/training/test_determinism.py::test_every_unary_op_mkl_computes_is_settled_when_qkov_is_imported",
    ),
    "resume: the computing environment of the state is not compared": (
        "training/loop.py",
        'changed = environment.differences(extra.get("environment", {}), session.environment)',
        "changed = []",
        "tests/training/test_determinism.py::test_a_state_records_what_its_bits_depend_on_and_a_resume_elsewhere_says_so",
    ),
    "discovery: a head sends to its own layer's heads (the edge rule)": (
        "analysis/discovery/graph.py",
        "        n = sum(1 for o in s_order if o < order)  # type: ignore[operator]",
        "        n = sum(1 for o in s_order if o <= order)  # type: ignore[operator]",
        "tests/analysis/discovery/test_attribution.py::test_the_graph_counts_every_sender_into_every_later_receiver",
    ),
    "discovery: the sign of a sender's change flipped in the contraction": (
        "analysis/discovery/grads.py",
        "        scores[:n, r0 : r0 + r] += weight * prod.to(scores.dtype)",
        "        scores[:n, r0 : r0 + r] -= weight * prod.to(scores.dtype)",
        "tests/analysis/discovery/test_attribution.py::test_eap_equals_the_gradient_of_every_edge_coefficient[gpt2-like]",
    ),
    "discovery: the MLP receiver's gradient read from the attention's input, not the MLP's own copy": (
        "analysis/discovery/grads.py",
        '            out[off] = _grad(recording, "mlp_input", l)',
        '            out[off] = _grad(recording, "resid_pre", l)',
        "tests/analysis/discovery/test_attribution.py::test_eap_equals_the_gradient_of_every_edge_coefficient[gpt2-like]",
    ),
    "discovery: a head's input gradient through a frozen norm divisor (its n.g term dropped)": (
        "analysis/discovery/grads.py",
        "                dst.addcmul_(((g * u).sum(-1) / D).permute(2, 0, 1)[..., None], nrm[None], value=-1)",
        "                pass",
        "tests/analysis/discovery/test_attribution.py::test_the_fast_and_split_receiver_gradients_agree[gpt2-like]",
    ),
    "discovery: the rotary value un-rotated by R^T instead of R^-1": (
        "analysis/discovery/grads.py",
        "                val = val / _turn_norm(turn, val.shape[-1])[None, :, None]",
        "                pass",
        "tests/analysis/discovery/test_attribution.py::test_the_fast_and_split_receiver_gradients_agree[llama-like]",
    ),
    "discovery: integrated edge gradients divided by m instead of m + 1 points": (
        "analysis/discovery/attribution.py",
        "        accumulate(_from(scores, runs.f), delta, split_grads(recording, graph), graph, weight / (steps + 1))",
        "        accumulate(_from(scores, runs.f), delta, split_grads(recording, graph), graph, weight / steps)",
        "tests/analysis/discovery/test_attribution.py::test_integrated_edge_gradients_equal_the_reference_at_every_point[gpt2-like]",
    ),
    "discovery: EAP-IG's input points include the clean end instead of the corrupted one": (
        "analysis/discovery/attribution.py",
        "        x = e_corr + (k / steps) * (e_clean - e_corr)",
        "        x = e_corr + ((k + 1) / steps) * (e_clean - e_corr)",
        "tests/analysis/discovery/test_attribution.py::test_eap_ig_over_the_inputs_equals_the_reference[gpt2-like]",
    ),
    "discovery: m(empty) taken as the corrupted run under zero ablation": (
        "analysis/discovery/score.py",
        '    empty = corrupted if abl.kind == "corrupted" else _empty(w, graph, task, abl, size)',
        "    empty = corrupted",
        "tests/analysis/discovery/test_attribution.py::test_eap_under_zero_and_mean_ablation_equals_the_reference[zero]",
    ),
    "discovery: exact patching recomputes a query or key without its bias": (
        "analysis/discovery/head_inputs.py",
        "            out = out + self.bias.view(n, *[1] * len(lead), E)",
        "            out = out",
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge[gpt2-like]",
    ),
    "block: the MLP's input copy is made but its edit never reaches the MLP": (
        "model/block.py",
        '                x = self.at("mlp_input", l, x.clone())',
        '                self.at("mlp_input", l, x.clone())',
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge[gpt2-like]",
    ),
    "discovery: an ablated edge carries the current value minus its replacement (sign)": (
        "analysis/discovery/senders.py",
        "        dz = (zr if pos is None else zr.index_select(2, pos)) - z",
        "        dz = z - (zr if pos is None else zr.index_select(2, pos))",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_circuits_run_as_the_reference_runs_them[corrupted-gpt2-like]",
    ),
    "discovery: a head with every edge in ablated reads the stream as it is, not its ablated input": (
        "analysis/discovery/masked.py",
        "                    view[k][:, :, f] = ablated[:, :, f]",
        "                    pass",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_nearly_empty_nearly_full_and_per_position_circuits_run_as_the_reference_runs_them[gpt2-like]",
    ),
    "forward: the last layer's few-positions block skips an edit of its keys": (
        "model/block.py",
        '        q, k = self.at_heads("q", l, q), self.at_heads("k", l, k)  # the queries at those positions only',
        '        q, k = self.at_heads("q", l, q), k',
        "tests/analysis/forward/test_forward.py::test_positions_with_the_last_layer_read_run_it_whole[llama-like]",
    ),
    "discovery: an integrated-gradient step's backward under the caller's no_grad (no graph)": (
        "analysis/discovery/attribution.py",
        "            with torch.enable_grad():  # whatever the caller's mode: the recording kept its graph\n                self.metric(rec).backward()",
        "            if True:\n                self.metric(rec).backward()",
        "tests/analysis/discovery/test_attribution.py::test_scores_are_the_same_inside_torch_no_grad",
    ),
    "discovery: a receiver read from its fully ablated input weighs its senders by W, not W - 1": (
        "analysis/discovery/masked.py",
        "        return torch.where(ii[:, None] if self.pos else ii, C - 1, C)",
        "        return torch.where(ii[:, None] if self.pos else ii, C, C)",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_nearly_empty_nearly_full_and_per_position_circuits_run_as_the_reference_runs_them[llama-like]",
    ),
    "discovery: a per-position circuit's coefficients ignore the position": (
        "analysis/discovery/masked.py",
        '                X = torch.einsum("umd,ucm->cmd", Dc, C[..., where[t0:t1] - f])',
        '                X = torch.einsum("umd,ucm->cmd", Dc, C[..., :1].expand(-1, -1, t1 - t0))',
        "tests/analysis/discovery/test_circuit_evaluation.py::test_nearly_empty_nearly_full_and_per_position_circuits_run_as_the_reference_runs_them[gpt2-like]",
    ),
    "discovery: dead-end pruning forgets that the input needs no edge in": (
        "analysis/discovery/circuit.py",
        "        has_in[0] = True  # the input needs no edge in",
        "        pass",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_pruning_removes_dead_ends_and_under_resampling_changes_nothing",
    ),
    "discovery: ROC points inside tie groups (ties not counted half)": (
        "analysis/discovery/roc.py",
        "(sr[1:] != sr[:-1]).nonzero()[:, 0]",
        "torch.arange(len(sr) - 1)",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_roc_auc_is_the_chance_a_true_edge_outranks_a_false_one",
    ),
    "discovery: the area under the faithfulness curve takes the left points only": (
        "analysis/discovery/faithfulness.py",
        "    return float(sum((x[i + 1] - x[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1)))",
        "    return float(sum((x[i + 1] - x[i]) * y[i] for i in range(len(x) - 1)))",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_the_faithfulness_curve_is_its_circuits_faithfulness_and_its_areas",
    ),
    "discovery: the logit difference sums the answers instead of averaging them": (
        "analysis/discovery/task.py",
        "            pick = lambda ids: logits.gather(-1, ids.to(dev)).mean(-1)  # noqa: E731",
        "            pick = lambda ids: logits.gather(-1, ids.to(dev)).sum(-1)  # noqa: E731",
        "tests/analysis/discovery/test_tasks.py::test_metrics_measure_what_they_say",
    ),
    "discovery: the induction task's corruption leaves the prefix match intact": (
        "analysis/discovery/builtin.py",
        "        corrupted.append(start + r[:-2] + [x, r[-1]] + r[:-1])",
        "        corrupted.append(start + r[:-1] + [x] + r[:-1])",
        "tests/analysis/discovery/test_tasks.py::test_the_induction_task_repeats_random_tokens_and_breaks_the_match "
        "tests/analysis/discovery/test_known_circuits.py::test_the_induction_circuit_ranks_first_on_the_hand_built_model",
    ),
    "discovery: the patching study's edge scores measured from the clean value whatever the direction": (
        "analysis/discovery/sweep.py",
        "    values = c.base_value + scores[g.src, g.dst].cpu()",
        "    values = c.clean_value + scores[g.src, g.dst].cpu()",
        "tests/analysis/discovery/test_attribution.py::test_edge_attribution_is_a_sweep_of_the_patching_study[denoise]",
    ),
    "discovery: ACDC keeps every edge (the criterion's sign flipped)": (
        "analysis/discovery/acdc.py",
        "        hit = next((j for j, v in enumerate(got) if v - kl < tau), None)",
        "        hit = next((j for j, v in enumerate(got) if kl - v > tau), None)",
        "tests/analysis/discovery/test_known_circuits.py::test_acdc_prunes_the_relay_model_down_to_its_path",
    ),
    "forward: a suffix's queries placed at the sequence's start, not after its past": (
        "model/block.py",
        "        z = self.offset_attention(q, expand_kv(k, self.group, dim=1), expand_kv(v, self.group, dim=1), rows + f)",
        "        z = self.offset_attention(q, expand_kv(k, self.group, dim=1), expand_kv(v, self.group, dim=1), rows)",
        "tests/analysis/forward/test_partial_passes.py::test_a_suffix_after_its_past_is_the_whole_pass_there[llama-like]",
    ),
    "forward: a suffix's rotary positions start at 0": (
        "analysis/forward/tracer.py",
        "            self.turn = (cos[f:], sin[f:])",
        "            self.turn = (cos[:T], sin[:T])",
        "tests/analysis/forward/test_partial_passes.py::test_a_suffix_after_its_past_is_the_whole_pass_there[llama-like]",
    ),
    "forward: a suffix's learned positions start at 0": (
        "model/ops.py",
        "    return None if W_pos is None else W_pos[offset : offset + seq]",
        "    return None if W_pos is None else W_pos[:seq]",
        "tests/analysis/forward/test_partial_passes.py::test_a_suffix_after_its_past_is_the_whole_pass_there[standard]",
    ),
    "forward: the last layer at a few positions passes its queries by their site": (
        "model/block.py",
        '        q, k = self.at_heads("q", l, q), self.at_heads("k", l, k)  # the queries at those positions only',
        '        q, k = q, self.at_heads("k", l, k)',
        "tests/analysis/forward/test_partial_passes.py::test_edits_that_take_the_rows_keep_the_last_layer_at_them[llama-like] "
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[gpt2-like]",
    ),
    "forward: the last layer at a few positions skips its output stream's site": (
        "model/block.py",
        '        return self.at("resid_post", l, x)  # with rows: at those positions only',
        '        return x if rows is not None else self.at("resid_post", l, x)',
        "tests/analysis/forward/test_partial_passes.py::test_edits_that_take_the_rows_keep_the_last_layer_at_them[llama-like] "
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[gpt2-like]",
    ),
    "discovery: a masked pass projects its receivers at the suffix's positions counted from 0 (rotary)": (
        "analysis/discovery/masked.py",
        "        where = (torch.arange(M, device=D.device) % P if pos is None else pos.repeat(self.B)) + f",
        "        where = torch.arange(M, device=D.device) % P if pos is None else pos.repeat(self.B)",
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[llama-like]",
    ),
    "discovery: the shared prefix takes in the first position where the prompts differ": (
        "analysis/discovery/ablations.py",
        "    first = int(differs[0]) if len(differs) else T",
        "    first = int(differs[0]) + 1 if len(differs) else T",
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[gpt2-like]",
    ),
    "discovery: a masked pass starts one layer after the first its circuits change": (
        "analysis/discovery/masked.py",
        "    return at.amin(-1) if at.shape[-1] else torch.full(at.shape[:1], L, device=flat.device)",
        "    return (at.amin(-1) + 1).clamp(max=L) if at.shape[-1] else torch.full(at.shape[:1], L, device=flat.device)",
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[gpt2-like]",
    ),
    "discovery: an MLP's input misses the part the senders before its layer give": (
        "analysis/discovery/masked.py",
        "                        view[k] += self.acc[k] if pos is None else self.acc[k].index_select(1, pos)",
        "                        pass",
        "tests/analysis/discovery/test_circuit_evaluation.py::test_circuits_run_as_the_reference_runs_them[corrupted-gpt2-like]",
    ),
    "discovery: a circuit with every edge from the source run taken as the base run": (
        "analysis/discovery/evaluate.py",
        "            total[firsts == L + 1] += weight * source",
        "            total[firsts == L + 1] += weight * p.contrast.base_value",
        "tests/analysis/discovery/test_masked_pass.py::test_every_edge_ablated_is_the_corrupted_run_without_a_pass_and_with_one[gpt2-like]",
    ),
    "discovery: a chunk of gathered changes reads the first ones, not those picked": (
        "analysis/discovery/masked.py",
        "            Dc = D[:, t0:t1] if pick is None else D[:, t0:t1].index_select(0, pick)",
        "            Dc = D[:, t0:t1] if pick is None else D[:, t0:t1][: len(pick)]",
        "tests/analysis/discovery/test_masked_pass.py::test_the_masked_pass_with_its_savings_equals_it_run_plainly_and_the_reference[gpt2-like]",
    ),
    "discovery: exact patching of one position patches the position as counted before the shared prefix": (
        "analysis/discovery/exact.py",
        "            keep[t - f] = 1",
        "            keep[min(t, d.shape[2] - 1)] = 1",
        "tests/analysis/discovery/test_masked_pass.py::test_exact_patching_with_its_savings_equals_it_run_plainly[llama-like]",
    ),
    "discovery: exact patching writes a last-layer query at the first positions, not the metric's": (
        "analysis/discovery/exact.py",
        "        got = new if value.shape[1] == new.shape[2] else new.index_select(2, rows)  # type: ignore[arg-type]",
        "        got = new if value.shape[1] == new.shape[2] else new[:, :, : value.shape[1]]",
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge[gpt2-like]",
    ),
    "discovery: exact patching rotates a suffix's queries and keys from position 0": (
        "analysis/discovery/exact.py",
        "positions=torch.arange(f, T))",
        "positions=torch.arange(0, T - f))",
        "tests/analysis/discovery/test_attribution.py::test_exact_patching_equals_the_reference_edge_by_edge[llama-like]",
    ),
    "discovery: a suffix's receiver gradients un-rotated from position 0": (
        "analysis/discovery/grads.py",
        "            turn = (cos[offset:], sin[offset:])",
        "            turn = (cos[:T], sin[:T])",
        "tests/analysis/discovery/test_masked_pass.py::test_attribution_from_the_shared_prefix_equals_it_from_the_first_position[llama-like]",
    ),
    "discovery: per-position attribution from the shared prefix lands on the first positions": (
        "analysis/discovery/attribution.py",
        "    return scores[f:] if scores.ndim == 3 else scores",
        "    return scores[: scores.shape[0] - f] if scores.ndim == 3 else scores",
        "tests/analysis/discovery/test_masked_pass.py::test_attribution_from_the_shared_prefix_equals_it_from_the_first_position[llama-like]",
    ),
    "discovery: a head's change from its mean misses the mean": (
        "analysis/discovery/senders.py",
        "        got += s if pos is None or s.shape[2] == 1 else s.index_select(2, pos)",
        "        got = got",
        "tests/analysis/discovery/test_masked_pass.py::test_the_means_and_zero_run_from_the_first_position_as_the_reference[mean]",
    ),
    "entries: an attention entry divided by its key's log-sum-exp, not its query's": (
        "analysis/heads/entries.py",
        "    out = (scores.transpose(1, 2) - _at(lse, 2, queries)).exp()  # [B, H, N]",
        "    out = (scores.transpose(1, 2) - _at(lse, 2, keys)).exp()  # [B, H, N]",
        "tests/analysis/heads/test_entries.py::test_entries_from_the_kernels_lse_are_the_patterns_own "
        "tests/analysis/series/test_measures.py::test_one_text_pass_gives_the_forwards_losses_and_the_patterns_previous_token_scores",
    ),
    "lse: the fused kernel's log-sum-exp taken over the wrong scale (the scores before dividing by sqrt(d_head))": (
        "model/ops.py",
        "    scale = 1.0 / score_divisor(q.shape[-1])\n    if lse and",
        "    scale = 1.0\n    if lse and",
        "tests/analysis/heads/test_entries.py::test_entries_from_the_kernels_lse_are_the_patterns_own",
    ),
    "text pass: every sequence of a chunk scored for the previous token, not only the first ones asked": (
        "analysis/series/measures.py",
        "        total[layer] += entries[:rows].double().sum((0, 2))",
        "        total[layer] += entries.double().sum((0, 2))",
        "tests/analysis/series/test_measures.py::test_one_text_pass_gives_the_forwards_losses_and_the_patterns_previous_token_scores",
    ),
    "induction probe: a written pattern ignored (the entries read from q, k and the unedited log-sum-exp)": (
        "analysis/heads/entries.py",
        '    return any(a.kind in ("scores", "lse", "pattern") for key in (edits or {}) for a in sites.resolve(key))',
        "    return False",
        "tests/analysis/heads/test_entries.py::test_the_probe_reads_entries_and_an_edited_pattern_where_one_is_written",
    ),
    "ICL score: the default passes hold every example at once again (fresh pages each pass)": (
        "analysis/heads/probes.py",
        "    return max(1, passes if width == 0 else min(LOGIT_BYTES // (width * cfg.d_vocab * item), passes))",
        "    return max(1, LOGIT_BYTES // (width * cfg.d_vocab * item))",
        "tests/analysis/heads/test_icl.py::test_default_icl_passes_hold_small_activations_and_give_one_passs_score",
    ),
    "trace: a recording without logits stops before the edits it was given": (
        "analysis/forward/tracer.py",
        "        sites = set(self.store.wanted) | set(self.edits.by_site)",
        "        sites = set(self.store.wanted)",
        "tests/analysis/forward/test_early_stop.py::test_edits_are_waited_for_and_start_at_and_grad_hold",
    ),
    "trace: a recording without logits waits for a site before its start (and runs to the end)": (
        "analysis/forward/tracer.py",
        ' and not (k == "embed" and start_at)}',
        "}",
        "tests/analysis/forward/test_early_stop.py::test_edits_are_waited_for_and_start_at_and_grad_hold",
    ),
    "explore: the ablated pass starts at the last ablated layer": (
        "apps/explore/views_causal.py",
        "    start = run.stream(min(h.layer for h in heads))",
        "    start = run.stream(max(h.layer for h in heads))",
        "tests/apps/test_explore_runs.py::test_views_are_equal_with_and_without_the_kept_run",
    ),
    "explore: the session drops its most recent text's run": (
        "apps/explore/runs.py",
        "                self._runs.popitem(last=False)",
        "                self._runs.popitem(last=True)",
        "tests/apps/test_explore_runs.py::test_a_session_keeps_a_few_texts_and_long_runs_without_streams",
    ),
    "patching: a study records its runs without the graph attribution reads (and records them again)": (
        "analysis/causal/studies.py",
        "        contrast.record(union.cache, base_only=union.base_only, grad=union.grad)",
        "        contrast.record(union.cache, base_only=union.base_only, grad=False)",
        "tests/analysis/causal/test_toolkit.py::test_a_study_shares_one_base_and_one_source_run_and_changes_no_number",
    ),
    "patching: the metric's gradient accumulates twice in a shared recording": (
        "analysis/causal/contrast.py",
        "                self.metric(self.base_recording).backward()\n            self.backed = True",
        "                self.metric(self.base_recording).backward(retain_graph=True)\n            self.backed = False",
        "tests/analysis/causal/test_toolkit.py::test_a_study_shares_one_base_and_one_source_run_and_changes_no_number",
    ),
    "patching: the logits at a patch's first changed position are taken from the base run": (
        "analysis/causal/contrast.py",
        "        later = every if every is None else every[every >= since]",
        "        later = every if every is None else every[every > since]",
        "tests/analysis/causal/test_patching_since.py::test_sweeps_with_a_metric_over_every_position_equal_one_patch_at_a_time",
    ),
    "patching: a head's patch taken to change nothing until one position after it does": (
        "analysis/causal/patching.py",
        "    first = torch.where(by_cell.any(-1), by_cell.int().argmax(-1), T)",
        "    first = torch.where(by_cell.any(-1), by_cell.int().argmax(-1) + 1, T)",
        "tests/analysis/causal/test_patching_since.py::test_sweeps_with_a_metric_over_every_position_equal_one_patch_at_a_time",
    ),
    "patching: a suffix pass's patch written one position late (the cells not moved to the suffix)": (
        "analysis/causal/patching.py",
        "[(*x[:at], x[at] - since, *x[at + 1 :]) for x in chunk]",
        "[(*x[:at], x[at] - since + 1, *x[at + 1 :]) for x in chunk]",
        "tests/analysis/causal/test_patching_since.py::test_suffix_passes_run_the_positions_from_the_first_change_only_and_change_no_number",
    ),
    "patching: a suffix pass starts from the whole base stream, not the suffix's": (
        "analysis/causal/patching.py",
        "                stream = base[(\"resid_pre\", start)][:, since:].detach()",
        "                stream = base[(\"resid_pre\", start)][:, :-since].detach()",
        "tests/analysis/causal/test_patching_since.py::test_suffix_passes_run_the_positions_from_the_first_change_only_and_change_no_number",
    ),
    "patching: a copy unembedded from its own first change counts one base position too few": (
        "analysis/causal/contrast.py",
        "            n = len(every) - len(m)  # positions before",
        "            n = len(every) - len(m) - 1  # positions before",
        "tests/analysis/causal/test_patching_since.py::test_each_copy_is_unembedded_from_its_own_first_change",
    ),
    "loss terms: the last position's term kept (it predicts no token)": (
        "analysis/causal/metrics.py",
        "        read = torch.arange(T - 1) if self.at is None",
        "        read = torch.arange(T) if self.at is None",
        "tests/analysis/causal/test_patching_since.py::test_the_loss_is_the_sum_of_its_position_terms",
    ),
    "loss terms: each position weighed by the positions of the pass, not of the loss": (
        "analysis/causal/metrics.py",
        "        weight[read] = 1.0 / len(read)",
        "        weight[read] = 1.0 / len(positions)",
        "tests/analysis/causal/test_patching_since.py::test_the_loss_is_the_sum_of_its_position_terms "
        "tests/analysis/causal/test_patching_since.py::test_sweeps_with_a_metric_over_every_position_equal_one_patch_at_a_time",
    ),
    "patching: a sender's path taken to begin one position late": (
        "analysis/causal/path_patch.py",
        "    return int(differs.int().argmax()) if bool(differs.any()) else len(differs)",
        "    return int(differs.int().argmax()) + 1 if bool(differs.any()) else len(differs)",
        "tests/analysis/causal/test_patching_since.py::test_the_work_saved_changes_no_number",
    ),
    "qkov patch: a qkov checkpoint loaded whole before its view": (
        "apps/cli/common.py",
        "    if streamable(args.ckpt):\n        w = Weights.from_source",
        "    if False:\n        w = Weights.from_source",
        "tests/apps/test_patch_cli.py::test_patch_reads_the_view_straight_from_a_checkpoint",
    ),
    'gated attention: the gate is computed but not multiplied into z': (
        'model/block.py',
        '        return z * (self.at_heads("gate", l, gate) if site else gate)',
        '        return z + 0 * (self.at_heads("gate", l, gate) if site else gate)',
        'tests/model/test_gate_loop.py::test_gated_attention_matches_a_hand_computation',
    ),
    'gated attention: the last layer at a few positions forgets its gate': (
        'model/block.py',
        "        z = self.gated(l, att, qk_in[:, rows], z, site=False)  # nothing reads the last layer's gate here",
        '        z = z',
        'tests/model/test_gate_loop.py::test_gated_passes_agree',
    ),
    'gated attention: the normalisation not folded into W_G': (
        'weights/view.py',
        '                ch["W_G"], ch["b_G"] = fold_reader(self.W_G, self.b_G, self.ln1_w, self.ln1_b, 2, inplace)  # type: ignore[arg-type]',
        '                ch["W_G"], ch["b_G"] = self.W_G, self.b_G',
        'tests/model/test_gate_loop.py::test_gated_passes_agree',
    ),
    'looped depth: effective layer l runs block l // loop instead of l % n_layers': (
        'model/transformer.py',
        '        return [self.blocks[l % n] for l in range(n * self.cfg.loop)]',
        '        return [self.blocks[l // self.cfg.loop] for l in range(n * self.cfg.loop)]',
        'tests/model/test_gate_loop.py::test_looped_model_is_its_unrolled_model',
    ),
    'looped depth: a looped checkpoint read lazily serves block l, not l % n_layers': (
        'weights/lazy.py',
        "        block = layer % self.stored_layers  # a looped model's effective layer runs this stored block",
        '        block = min(layer, self.stored_layers - 1)',
        'tests/model/test_gate_loop.py::test_looped_gated_checkpoint_round_trip',
    ),
    "paths: a head's order-1 term ignores its frozen gate": (
        'analysis/forward/frozen.py',
        '    return head_writes(pattern, v, W_O, frozen_gate(recording, layer, heads)).transpose(0, 1)',
        '    return head_writes(pattern, v, W_O).transpose(0, 1)',
        'tests/analysis/paths/test_paths_gated.py::test_gated_and_looped_paths_sum_to_the_logits tests/analysis/paths/test_paths_gated.py::test_order_one_terms_are_the_heads_own_outputs',
    ),
    'paths: the frozen recording does not record the gates': (
        'analysis/forward/frozen.py',
        'FROZEN_KINDS = ("pattern", "attn_scale", "qk_scale", "mlp_scale", "final_scale", "mlp_out", "gate", *ROUTE_KINDS)',
        'FROZEN_KINDS = ("pattern", "attn_scale", "qk_scale", "mlp_scale", "final_scale", "mlp_out", *ROUTE_KINDS)',
        'tests/analysis/paths/test_paths_gated.py::test_term_importance_is_the_literal_procedure_with_the_gates_frozen',
    ),
    "term importance: the heads' summed write ignores the frozen gate": (
        'analysis/paths/routed.py',
        '    return write_heads(gated(real, layer, real["pattern", layer] @ v), source.attention(layer, expand_kv=False).W_O)',
        '    return write_heads(real["pattern", layer] @ v, source.attention(layer, expand_kv=False).W_O)',
        'tests/analysis/paths/test_paths_gated.py::test_term_importance_is_the_literal_procedure_with_the_gates_frozen',
    ),
    "paths: b_V's term ignores the gate of the query": (
        'analysis/paths/expansion.py',
        '            new_bias = torch.einsum("bhte,hed->btd", att.b_V[None, :, None] * g, att.W_O) + att.b_O',
        '            new_bias = torch.einsum("bhte,hed->btd", att.b_V[None, :, None] + 0 * g, att.W_O) + att.b_O',
        'tests/analysis/paths/test_paths_gated.py::test_gated_and_looped_paths_sum_to_the_logits',
    ),
    "virtual heads: the reader's frozen gate left out": (
        'analysis/paths/virtual.py',
        '                z = z * g[:, 0, :, None]',
        '                z = z',
        'tests/analysis/paths/test_paths_gated.py::test_gated_and_looped_paths_sum_to_the_logits',
    ),
    'term effects: a sampled term read through its gated head without the gate': (
        'analysis/paths/effects.py',
        '        y = y * g[b, 0, t]',
        '        y = y',
        'tests/analysis/paths/test_paths_gated.py::test_sampled_term_logits_through_a_gated_head',
    ),
    'gate stats: the token dependence unweighted by how often each token occurs': (
        'analysis/heads/gates.py',
        '    between = (counts * (sums / counts - mean).pow(2)).sum(0)',
        '    between = ((sums / counts - mean).pow(2)).sum(0) * len(v) / len(ids)',
        'tests/analysis/heads/test_gates.py::test_gate_stats_by_hand',
    ),
    'gate tools: the effective OV ignores the gate': (
        'analysis/heads/gates.py',
        '    return LowRank(W_V * g, W_O)',
        '    return LowRank(W_V, W_O)',
        'tests/analysis/heads/test_gates.py::test_effective_ov_is_what_the_head_writes',
    ),
    "bus: the AttnRes routing softmax at the wrong temperature (the training model and the trace alike)": (
        "model/bus.py",
        "return torch.softmax(logits, dim=-1)",
        "return torch.softmax(logits / 2, dim=-1)",
        "tests/model/test_bus.py::test_attnres_reads_the_softmax_of_its_pseudo_queries_over_normalised_sources",
    ),
    "bus: the AttnRes keys not normalised": (
        "model/bus.py",
        "logits = torch.stack([(v @ u) * r for v, r in zip(sources, scales)], dim=-1)",
        "logits = torch.stack([v @ u for v in sources], dim=-1)",
        "tests/model/test_bus.py::test_attnres_reads_the_softmax_of_its_pseudo_queries_over_normalised_sources",
    ),
    "bus: Sinkhorn-Knopp normalises rows before columns (not the paper's order)": (
        "model/bus.py",
        "            for dim in (0, 1):",
        "            for dim in (1, 0):",
        "tests/model/test_bus.py::test_sinkhorn_is_doubly_stochastic_and_keeps_what_already_is "
        "tests/model/test_bus.py::test_streams_read_mix_and_write_as_recorded",
    ),
    "bus: static hyper-connections' sources not mixed (G <- [G | w])": (
        "model/bus.py",
        "self.G = torch.cat([Ms @ self.G, ws[:, None].expand(-1, len(outs))], 1)",
        "self.G = torch.cat([self.G, ws[:, None].expand(-1, len(outs))], 1)",
        "tests/model/test_bus.py::test_streams_read_mix_and_write_as_recorded",
    ),
    "bus: static hyper-connections' sources read without the read weights": (
        "model/bus.py",
        "return _weighted(shared @ self.G, self.sources)",
        "return _weighted(self.G.sum(0), self.sources)",
        "tests/model/test_bus.py::test_streams_read_mix_and_write_as_recorded",
    ),
    "bus: the hyper-connection write ignores its weights (streams built, stream-major)": (
        "model/bus.py",
        "H = torch.cat([Ms, ws[:, None]], 1) @ torch.cat([self.H, outs[0].reshape(1, -1)], 0)",
        "H = torch.cat([Ms, torch.ones_like(ws)[:, None]], 1) @ torch.cat([self.H, outs[0].reshape(1, -1)], 0)",
        "tests/model/test_bus.py::test_static_streams_held_any_way_agree",
    ),
    "bus: the hyper-connection write ignores its weights (streams held token-major: dynamic, mHC)": (
        "model/bus.py",
        "H = torch.cat([M, w[..., None]], -1) @ torch.cat([self.H, outs[0][:, :, None, :]], -2)",
        "H = torch.cat([M, torch.ones_like(w)[..., None]], -1) @ torch.cat([self.H, outs[0][:, :, None, :]], -2)",
        "tests/model/test_bus.py::test_streams_read_mix_and_write_as_recorded",
    ),
    "bus: stream-major streams turned token-major by reinterpreting their memory": (
        "model/bus.py",
        "self.H = self.H.view(-1, B, T, D).permute(1, 2, 0, 3).contiguous()",
        "self.H = self.H.view(B, T, -1, D)",
        "tests/model/test_bus.py::test_static_streams_held_any_way_agree",
    ),
    "bus: the Sinkhorn gradient without the term of the sums": (
        "model/bus.py",
        "grad = (grad - (grad * y).sum(dim=k % 2, keepdim=True)) / c",
        "grad = grad / c",
        "tests/model/test_bus.py::test_sinkhorn_gradient_is_the_gradient_of_its_rounds",
    ),
    "training: a run leaves the process group a script joined": (
        "training/loop.py",
        "    if plan.joined:\n        distributed.teardown(plan.dist)",
        "    distributed.teardown(plan.dist)",
        "tests/model/test_bus.py::test_every_other_variant_trains_the_same_under_torchrun",
    ),
    "routed paths: a head's order-1 term reaches the final read with the previous sublayer's coefficient": (
        "analysis/paths/routed.py",
        "heads = {key: C[S, s + 1][..., None] * term for key, (s, term) in head_outs.items()}",
        "heads = {key: C[S, s][..., None] * term for key, (s, term) in head_outs.items()}",
        "tests/analysis/paths/test_routed.py::test_hand_built_routing_gives_the_known_path_coefficients",
    ),
    "path patching on a routed model: the sender's change reaches the receiver unscaled by its routing": (
        "analysis/causal/path_patch.py",
        "    return delta * reach[..., None].to(delta)",
        "    return delta",
        "tests/analysis/causal/test_path_patch_routed.py::test_path_patching_into_a_key_through_the_routes_equals_the_frozen_bus "
        "tests/analysis/causal/test_path_patch_routed.py::test_path_patching_into_the_logits_through_the_routes_equals_the_frozen_bus",
    ),
    "path patching on a routed model: a sender read at the previous source (the embedding slot forgotten)": (
        "analysis/causal/path_patch.py",
        "reach = torch.stack([C[p, 1 + attention_point(cfg, s.layer)] for s in senders])",
        "reach = torch.stack([C[p, attention_point(cfg, s.layer)] for s in senders])",
        "tests/analysis/causal/test_path_patch_routed.py::test_path_patching_into_a_key_through_the_routes_equals_the_frozen_bus",
    ),
    "path patching into a routed model's logits: the change scaled as the last sublayer's input, not the final read's": (
        "analysis/causal/path_patch.py",
        "d = _reach(cfg, C, cfg.sublayers, chunk, delta)",
        "d = _reach(cfg, C, cfg.sublayers - 1, chunk, delta)",
        "tests/analysis/causal/test_path_patch_routed.py::test_path_patching_into_the_logits_through_the_routes_equals_the_frozen_bus",
    ),
    "one sender's paths into each input on a routed model: the change unscaled by its routing": (
        "analysis/causal/path_patch.py",
        "change = _reach(cfg, _routing(c), attention_point(cfg, l2), [s], change)[0]",
        "change = change[0]",
        "tests/analysis/causal/test_path_patch_routed.py::test_composition_paths_through_the_routes_equal_the_frozen_bus",
    ),
    "K path share: the loss read from the first copy's last token too (no induction can predict it)": (
        "analysis/causal/composition.py",
        "metric=Loss(tokens=clean, at=range(L + 1, 2 * L))",
        "metric=Loss(tokens=clean, at=range(L, 2 * L))",
        "tests/analysis/causal/test_k_path_share.py::test_each_loss_of_the_share_equals_a_plain_run_edited_by_hand",
    ),
    "K path share: the path into the reader's queries, not its keys": (
        "analysis/causal/composition.py",
        'patch_paths(c, receivers=[reader], input="k", senders=[writer])',
        'patch_paths(c, receivers=[reader], input="q", senders=[writer])',
        "tests/analysis/causal/test_k_path_share.py::test_the_hand_built_induction_heads_effect_runs_through_its_keys "
        "tests/analysis/causal/test_k_path_share.py::test_each_loss_of_the_share_equals_a_plain_run_edited_by_hand",
    ),
    "architectures: the induction circuit's writer taken from the reader's own layer": (
        "apps/architectures.py",
        "for l in range(reader[0]) for h in range(len(prev[l]))",
        "for l in range(reader[0] + 1) for h in range(len(prev[l]))",
        "tests/apps/test_architectures.py::test_the_induction_circuit_is_the_best_induction_head_and_an_earlier_previous_token_head",
    ),
    "trace: a routed model started at an earlier layer than its final read": (
        "analysis/forward/tracer.py",
        'if cfg.residual != "sum" and layer != cfg.n_layers:',
        'if cfg.residual != "sum" and layer > cfg.n_layers:',
        "tests/analysis/causal/test_path_patch_routed.py::test_a_routed_model_starts_at_its_final_read_and_nowhere_else",
    ),
    "routed paths: the streams' coefficients carried through the transposed mixing": (
        "model/bus.py",
        "g = [(M @ gj[..., None])[..., 0] for gj in g] + [w]",
        "g = [(M.transpose(-1, -2) @ gj[..., None])[..., 0] for gj in g] + [w]",
        "tests/analysis/paths/test_routed.py::test_terms_sum_to_the_logits",
    ),
    "streamed forward: the embedding rows indexed by token id, not by their place among the rows read": (
        "analysis/forward/tracer.py",
        "    return embed(inverse, torch.cat(runs), None)[0]",
        "    return embed(tokens.remainder(len(values)), torch.cat(runs), None)[0]",
        "tests/weights/test_lazy.py::test_the_streamed_forward_reads_the_tokens_rows_and_the_unembedding_in_blocks",
    ),
    "streamed forward: each unembedding block's bias left out": (
        "analysis/forward/tracer.py",
        "            block = block if b_U is None else block + b_U",
        "            block = block",
        "tests/weights/test_lazy.py::test_the_streamed_forward_reads_the_tokens_rows_and_the_unembedding_in_blocks",
    ),
    "streamed forward: every unembedding block written to the first columns": (
        "analysis/forward/tracer.py",
        "                logits[..., cols] = block",
        "                logits[..., : cols.stop - cols.start] = block",
        "tests/apps/test_explore_streamed.py::test_the_views_give_the_in_memory_numbers",
    ),
    "lazy: a sum that overflows taken for a NaN (finite values refused)": (
        "weights/lazy.py",
        "        if not bool(t.sum().isfinite()) and not all(bool(part.isfinite().all()) for part in t.reshape(-1).split(_BLOCK)):",
        "        if not bool(t.sum().isfinite()):",
        "tests/weights/test_lazy.py::test_non_finite_values_are_refused_and_huge_finite_ones_are_not",
    ),
    "explorer streamed: the progress of a layer reported as the next one": (
        "apps/explore/runs.py",
        'progress(f"reading layer {site.layer} of {ex.cfg.n_layers} from disk", site.layer, total)',
        'progress(f"reading layer {site.layer} of {ex.cfg.n_layers} from disk", site.layer + 1, total)',
        "tests/apps/test_explore_streamed.py::test_a_streamed_text_reports_each_layer_as_it_reads_it",
    ),
    "explorer streamed: the views that read every layer many times run anyway": (
        "apps/explore/views.py",
        "        if ex.streamed:\n            raise BadRequest(",
        "        if False:\n            raise BadRequest(",
        "tests/apps/test_explore_streamed.py::test_views_that_would_read_every_layer_many_times_are_one_line",
    ),
    "explorer: the loaded model kept beside its folded view (two copies)": (
        "apps/explore/session.py",
        "                self.model = None\n",
        "",
        "tests/apps/test_explore_streamed.py::test_an_in_memory_session_keeps_one_copy",
    ),
    "explorer streamed: the text bounded by its logits' elements, not their bytes": (
        "apps/explore/session.py",
        "STREAMED_LOGITS_BYTES // (4 * cfg.d_vocab)",
        "STREAMED_LOGITS_BYTES // cfg.d_vocab",
        "tests/apps/test_explore_streamed.py::test_a_streamed_text_is_bounded_by_its_logits",
    ),
    "explorer card: its composition read from head 0's weights": (
        "apps/explore/views_card.py",
        "    mine = w.attention(layer, head)  # [1, ...]: this head",
        "    mine = w.attention(layer, 0)  # [1, ...]: this head",
        "tests/apps/test_explore_views.py::test_composition_graph_is_all_pairs_and_matches_the_cards",
    ),
    "explorer page, streamed: a card's vocabulary tables start without being asked": (
        "apps/explore/static/explore.js",
        "      if (!M.streamed) { tables(); return; }",
        "      if (true) { tables(); return; }",
        "tests/apps/test_explore_streamed_browser.py",
    ),
    "explorer page, streamed: the heads table started though it is not answered": (
        "apps/explore/static/explore.js",
        "  if (!OFF.heads) P.heads.run(\"heads\", {}, drawHeads);",
        "  P.heads.run(\"heads\", {}, drawHeads);",
        "tests/apps/test_explore_streamed_browser.py",
    ),
    "streamed gradient: the blocks not checkpointed (every layer's weights held until the backward)": (
        "analysis/forward/tracer.py",
        "        if not (self.grad and self.streamed and self.bus is None and self.pending is None and torch.is_grad_enabled()):",
        "        if True:",
        "tests/weights/test_lazy.py::test_a_gradient_through_the_streamed_forward_is_the_in_memory_views_and_holds_no_layer",
    ),
    "streamed gradient: the unembedding's backward keeps W_U's blocks": (
        "analysis/forward/tracer.py",
        "        if self.streamed and self.grad and final.requires_grad:",
        "        if False:",
        "tests/weights/test_lazy.py::test_a_gradient_through_the_streamed_forward_is_the_in_memory_views_and_holds_no_layer",
    ),
    "streamed gradient: a replayed block caches its sites again (their gradients lost)": (
        "analysis/forward/tracer.py",
        "        if self.replaying:\n            return value\n",
        "",
        "tests/weights/test_lazy.py::test_a_gradient_through_the_streamed_forward_is_the_in_memory_views_and_holds_no_layer",
    ),
    "streamed circuit: --lazy ignored (the model loaded whole)": (
        "apps/cli/circuit_cmds.py",
        "    if lazy(args):  # a model larger than memory",
        "    if False:  # a model larger than memory",
        "tests/apps/test_circuit_cli.py::test_a_streamed_model_finds_the_same_circuit",
    ),
    "streamed circuit: the allocator tuned for a streamed model too (its heap grows a layer per layer)": (
        "device.py",
        '    if getattr(source, "in_memory", False):',
        '    if True:',
        "tests/analysis/discovery/test_attribution.py::test_the_allocator_keeps_freed_memory_for_a_model_in_memory_only",
    ),
}


def _passes(tests: str) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()]
    # this checkout's src first: an editable install of another checkout must not be what is tested
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).returncode == 0


def plant(name: str, relpath: str, old: str, new: str, tests: str) -> bool:
    """Apply one bug, run its tests, restore; True when the tests failed (the bug was caught)."""
    path = SRC / relpath
    original = path.read_text()
    if original.count(old) != 1:
        print(f"?? {name}: the text to change occurs {original.count(old)} times in {relpath}")
        return False
    if not _passes(tests):
        print(f"?? {name}: {tests} fail without the bug")
        return False
    try:
        path.write_text(original.replace(old, new))
        caught = not _passes(tests)
    finally:
        path.write_text(original)
    print(f"{'caught' if caught else 'MISSED'}: {name} ({tests})")
    return caught


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only the bugs whose name contains this")
    args = ap.parse_args()
    results = [plant(name, *bug) for name, bug in BUGS.items() if args.k in name]
    print(f"{sum(results)} of {len(results)} planted bugs caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
