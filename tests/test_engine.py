"""The speculative engine on a tiny random Llama: exact greedy parity with HF `generate`, exact
accept counts with stub drafts, the drafter protocol against a fresh recomputation, and the
sampling distribution under rejection sampling."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from scipy import stats as sstats
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from eagle3.config import Eagle3Config
from eagle3.model import DrafterCache, Eagle3Drafter
from serve.engine import (
    DraftTree,
    EagleDraft,
    GenParams,
    SpecEngine,
    StaticTargetRunner,
    TargetRunner,
    check_drafter_for_target,
    random_drafter,
    use_small_rows_linear,
)

K = 3  # draft steps
N_TOK = 16  # completion tokens per request
AUX = [0, 1, 2]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 30, (20,), generator=g)
    return [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    """prompt + the target's own greedy continuation (HF generate, one prompt at a time), long
    enough that an oracle can always propose K tokens past the last verified one."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = target.generate(torch.tensor([p]), max_new_tokens=N_TOK + K + 2, do_sample=False)
            out.append(seq[0].tolist())
    assert all(len(s) == len(p) + N_TOK + K + 2 for s, p in zip(out, prompts, strict=True)), (
        "hit eos"
    )
    return out


class OracleDraft:
    """Stub draft source: proposes the target's greedy continuation, so every draft is accepted;
    `corrupt(request, position)` replaces chosen drafts by a token the target does not pick.
    Records the accept count each proposal must get (the index of its first corrupted draft)."""

    aux_layer_ids = AUX

    def __init__(self, refs: list[list[int]], corrupt=lambda req, pos: False):
        self.refs, self.corrupt = refs, corrupt

    def start(self, batch: int, capacity: int) -> None:
        self.rows = list(range(batch))
        self.expected = [[] for _ in range(batch)]

    def extend(self, ids, aux, positions, write) -> None:
        last = torch.where(write, torch.arange(write.shape[1]), -1).max(1).values
        self.pos = positions[torch.arange(len(last)), last]

    def propose(self, steps, temperature, gen, top_p=1.0, top_k=0):
        drafts = []
        for b, req in enumerate(self.rows):
            t = int(self.pos[b])  # slot t holds token x_{t+1}; draft j is the token at t+1+j
            row = [self.refs[req][t + 1 + j] for j in range(1, steps + 1)]
            bad = [self.corrupt(req, t + 1 + j) for j in range(1, steps + 1)]
            row = [(x + 1) % 49152 if c else x for x, c in zip(row, bad, strict=True)]
            self.expected[req].append(bad.index(True) if any(bad) else steps)
            drafts.append(row)
        return torch.tensor(drafts), None

    def select(self, rows) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.pos = self.pos[rows]


def completions(refs, prompts, n=N_TOK):
    return [r[len(p) : len(p) + n] for r, p in zip(refs, prompts, strict=True)]


def test_greedy_equals_hf_generate_with_random_drafter(target, prompts, reference):
    engine = SpecEngine(
        target, random_drafter(target, draft_vocab_size=2000, aux_layer_ids=AUX), steps=K
    )
    want = completions(reference, prompts)
    batched = engine.generate(prompts, GenParams(max_tokens=N_TOK))  # ragged batch of 20
    assert [g.token_ids for g in batched] == want
    single = [engine.generate([p], GenParams(max_tokens=N_TOK))[0] for p in prompts[:4]]
    assert [g.token_ids for g in single] == want[:4]
    plain = engine.plain_generate(prompts, GenParams(max_tokens=N_TOK))
    assert [g.token_ids for g in plain] == want
    for g in batched:
        s = g.stats
        assert s.completion_tokens == N_TOK and s.finish_reason == "length"
        assert s.spec_verify_ct == sum(s.accept_hist) and s.accepted_drafts <= K * s.spec_verify_ct
        assert s.accept_len == pytest.approx(N_TOK / s.spec_verify_ct)
        assert s.draft_ms > 0 and s.verify_ms > 0
    assert all(g.stats.spec_verify_ct == 0 for g in plain)


@pytest.mark.parametrize("batch", [1, 7])
def test_accept_all_gives_k_plus_1_and_reject_all_gives_1(target, prompts, reference, batch):
    ps, refs = prompts[:batch], reference[:batch]
    n = 1 + 4 * (K + 1)  # prefill token + four full cycles
    engine = SpecEngine(target, OracleDraft(refs), steps=K)
    out = engine.generate(ps, GenParams(max_tokens=n))
    assert [g.token_ids for g in out] == completions(refs, ps, n)
    for g in out:
        assert g.stats.spec_verify_ct == 4 and g.stats.accepted_drafts == 4 * K
        assert g.stats.cycle_accept_len == K + 1 and g.stats.accept_hist == [0, 0, 0, 4]

    engine.set_drafter(OracleDraft(refs, corrupt=lambda req, pos: True))
    out = engine.generate(ps, GenParams(max_tokens=n))
    assert [g.token_ids for g in out] == completions(refs, ps, n)
    for g in out:
        assert g.stats.spec_verify_ct == n - 1 and g.stats.accepted_drafts == 0
        assert g.stats.cycle_accept_len == 1 and g.stats.accept_len == n / (n - 1)


def test_partial_acceptance_in_a_ragged_batch(target, prompts, reference):
    """Rows accept different counts each cycle (masked holes in the target cache, rows finishing
    at different cycles); output stays exact and each accept count is the predicted one."""
    corrupt = lambda req, pos: (req * 7 + pos * 3) % 5 == 0  # noqa: E731
    oracle = OracleDraft(reference, corrupt)
    engine = SpecEngine(target, oracle, steps=K)
    limits = [N_TOK - (i % 5) for i in range(len(prompts))]
    out = engine.generate(prompts, GenParams(max_tokens=N_TOK), max_tokens_each=limits)
    assert [g.token_ids for g in out] == [
        c[:n] for c, n in zip(completions(reference, prompts), limits, strict=True)
    ]
    for req, g in enumerate(out):
        want = [0] * (K + 1)
        for a in oracle.expected[req]:
            want[a] += 1
        assert g.stats.accept_hist == want
        assert g.stats.spec_verify_ct == len(oracle.expected[req])
    assert sum(g.stats.accepted_drafts for g in out) > 0
    assert len({tuple(g.stats.accept_hist) for g in out}) > 1


def test_stop_token_ends_a_request_like_generate(target, prompts, reference):
    p, seq = prompts[0], reference[0]
    stop = seq[len(p) + 5]
    cont = seq[len(p) : len(p) + N_TOK]
    want = cont[: cont.index(stop) + 1]  # generate's eos rule: stop after the first stop token
    engine = SpecEngine(target, OracleDraft(reference[:1]), steps=K, stop_ids={stop})
    g = engine.generate([p], GenParams(max_tokens=N_TOK))[0]
    assert g.token_ids == want and g.stats.finish_reason == "stop"
    g = engine.generate([p], GenParams(max_tokens=N_TOK, ignore_eos=True))[0]
    assert len(g.token_ids) == N_TOK and g.stats.finish_reason == "length"


def test_hf_kernels_without_the_fast_linear(tiny_target, prompts, reference):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    engine = SpecEngine(
        model,
        random_drafter(model, draft_vocab_size=2000, aux_layer_ids=AUX),
        steps=K,
        fast_linear=False,
    )
    assert not any(hasattr(m, "_small_rows") for m in model.modules())
    out = engine.generate(prompts[:8], GenParams(max_tokens=N_TOK))
    assert [g.token_ids for g in out] == completions(reference[:8], prompts[:8])


class RecordingEagle(EagleDraft):
    """The real EAGLE drafter, but each draft follows the target's greedy continuation so drafts
    are accepted and extends span several slots. Records the step-1 logits of every row."""

    def __init__(self, model, refs):
        super().__init__(model)
        self.refs, self.log, self.log2 = refs, [], []

    def start(self, batch, capacity):
        super().start(batch, capacity)
        self.rows = list(range(batch))

    def extend(self, ids, aux, positions, write):
        super().extend(ids, aux, positions, write)
        for b, req in enumerate(self.rows):
            self.log.append((req, int(self.pos[b]), self.logits[b].clone()))

    def propose(self, steps, temperature, gen, top_p=1.0, top_k=0):
        self._j = 0
        return super().propose(steps, temperature, gen, top_p, top_k)

    def _pick(self, logits, temperature, gen, top_p=1.0, top_k=0):
        self._j += 1
        if self._j == 2:  # logits of draft step 2 (fed draft 1 and step 1's own state)
            self.log2 += [
                (req, int(self.pos[b]), logits[b].clone()) for b, req in enumerate(self.rows)
            ]
        ids = [self.refs[req][int(self.pos[b]) + 1 + self._j] for b, req in enumerate(self.rows)]
        return torch.tensor(ids), None  # identity draft vocab: draft id == target id

    def select(self, rows):
        super().select(rows)
        self.rows = [self.rows[i] for i in rows.tolist()]


def test_drafter_protocol_matches_fresh_recomputation(target, prompts, reference):
    """Every incremental drafter state equals one extend over the whole verified sequence with
    the target's full-forward aux states (SGLang id k = hidden_states[k+1])."""
    base = random_drafter(target, aux_layer_ids=AUX, seed=3).model
    drafter = RecordingEagle(base, reference)
    engine = SpecEngine(target, drafter, steps=K)
    out = engine.generate(prompts[:6], GenParams(max_tokens=N_TOK))
    assert all(
        g.stats.accepted_drafts == K * g.stats.spec_verify_ct for g in out
    )  # multi-slot extends
    assert drafter.log2
    with torch.inference_mode():
        for req, g in enumerate(out):
            seq = torch.tensor([prompts[req] + g.token_ids])
            hs = target(seq, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[k + 1] for k in AUX], -1)
            T = seq.shape[1] - 1
            cache = DrafterCache(base.cfg, 1, T + 8)
            _, fresh = base.forward_step(seq[:, 1:], aux[:, :T], torch.arange(T)[None], cache)
            logged = [(pos, lg) for r, pos, lg in drafter.log if r == req]
            assert (
                len(logged) == g.stats.spec_verify_ct
            )  # prefill extend + one per unfinished cycle
            for pos, lg in logged:
                torch.testing.assert_close(lg, fresh[0, pos], rtol=1e-4, atol=1e-4)
            for r, t, lg in drafter.log2:  # step 2 from slot t: (x_{t+2}, own state, position t+1)
                if r != req:
                    continue
                cache = DrafterCache(base.cfg, 1, T + 8)
                h, _ = base.forward_step(
                    seq[:, 1 : t + 2], aux[:, : t + 1], torch.arange(t + 1)[None], cache
                )
                _, lg2 = base.forward_step(
                    seq[:, t + 2 : t + 3], h[:, -1:], torch.tensor([[t + 1]]), cache
                )
                torch.testing.assert_close(lg, lg2[0, 0], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Tree drafting (topk > 1, greedy)


class OracleTree(OracleDraft):
    """Stub tree: the true continuation as one branch of depth K, with a wrong sibling at every
    depth, a wrong first child of the root, and a decoy carrying the next true token under the
    wrong branch (a wrong mask or walk would accept it)."""

    def propose_tree(self, steps, topk, num_nodes):
        toks, pars, deps = [], [], []
        for b, req in enumerate(self.rows):
            t = int(self.pos[b])
            true = [self.refs[req][t + 1 + j] for j in range(1, steps + 1)]
            wrong = [(x + 7) % 49152 for x in true]
            row_t, row_p, row_d = [wrong[0], true[0]], [-1, -1], [1, 1]  # nodes 0, 1
            row_t.append(true[1]), row_p.append(0), row_d.append(2)  # decoy under the wrong branch
            parent = 1
            for j in range(1, steps):
                row_t += [wrong[j], true[j]]
                row_p += [parent, parent]
                row_d += [j + 1, j + 1]
                parent = len(row_t) - 1
            toks.append(row_t), pars.append(row_p), deps.append(row_d)
            self.expected[req].append(steps)
        return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(deps))


def test_tree_oracle_accepts_the_true_branch_exactly(target, prompts, reference):
    oracle = OracleTree(reference)
    engine = SpecEngine(target, oracle, steps=K, topk=2)
    n = 1 + 3 * (K + 1)
    out = engine.generate(prompts[:5], GenParams(max_tokens=n, num_draft_tokens=2 * K + 2))
    assert [g.token_ids for g in out] == completions(reference[:5], prompts[:5], n)
    for g in out:
        assert g.stats.spec_verify_ct == 3 and g.stats.cycle_accept_len == K + 1


def test_tree_greedy_equals_hf_generate(target, prompts, reference):
    engine = SpecEngine(
        target,
        random_drafter(target, draft_vocab_size=2000, aux_layer_ids=AUX),
        steps=K,
        topk=3,
        num_draft_tokens=7,
    )
    want = completions(reference, prompts)
    assert [g.token_ids for g in engine.generate(prompts, GenParams(max_tokens=N_TOK))] == want
    assert [
        g.token_ids
        for g in engine.generate(prompts[:3], GenParams(max_tokens=N_TOK, num_draft_tokens=10))
    ] == want[:3]


def test_tree_expansion_matches_chain_steps(target, prompts):
    """A tree node's drafter state equals the chain step along its path (same math, ancestors
    from the tree's own entries instead of the cache)."""
    drafter = random_drafter(target, aux_layer_ids=AUX, seed=4)
    runner = TargetRunner(target)
    runner.set_aux_layers(AUX)
    with torch.inference_mode():
        logits, aux, ids, valid = runner.prefill(prompts[:3], aux=True)
        drafter.start(3, 64)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        drafter.extend(torch.cat([ids[:, 1:], logits.argmax(-1)[:, None]], 1), aux, pos, valid)
        chain, _ = drafter.propose(K, 0.0, None)
        as_tree = drafter.propose_tree(K, 1, K)  # a chain is a tree with one child per node
        assert torch.equal(as_tree.tokens, chain) and as_tree.parents.tolist() == [[-1, 0, 1]] * 3
        # depth 2 by hand: chain step vs tree step with the depth-1 entry as ancestor
        d1 = chain[:, :1]
        h1 = drafter._prenorm(d1, drafter.h[:, None], (drafter.pos + 1)[:, None], None)
        e = drafter.cache.k.new_zeros(3, drafter.cache.k.shape[1], 0, drafter.cache.k.shape[-1])
        t1, k1, v1 = drafter._tree_step(
            d1, drafter.h[:, None], torch.zeros(3, 1, 0, dtype=torch.bool), e, e
        )
        torch.testing.assert_close(t1, h1, rtol=1e-5, atol=1e-5)
        d2 = chain[:, 1:2]
        h2 = drafter._prenorm(d2, h1, (drafter.pos + 2)[:, None], None)
        t2, _, _ = drafter._tree_step(d2, t1, torch.ones(3, 1, 1, dtype=torch.bool), k1, v1)
        torch.testing.assert_close(t2, h2, rtol=1e-5, atol=1e-5)
        wide = drafter.propose_tree(K, 3, 9)
    assert wide.tokens.shape == (3, 9)
    assert all(p < i for row in wide.parents.tolist() for i, p in enumerate(row))  # parents first
    assert (wide.depths <= K).all() and (wide.depths[wide.parents < 0] == 1).all()


def test_compaction_keeps_attention_results(target, prompts):
    runner = TargetRunner(target)
    runner.set_aux_layers(AUX)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        runner.prefill(prompts[:3], aux=False)
        pos = torch.tensor([len(p) for p in prompts[:3]])
        for keep_n in ([1, 4, 2], [3, 1, 1], [2, 2, 4]):
            ids = torch.randint(3, 49152, (3, 4), generator=g)
            vpos = pos[:, None] + torch.arange(4)
            runner.forward(ids, vpos, torch.ones(3, 4, dtype=torch.bool))
            keep = torch.arange(4)[None] < torch.tensor(keep_n)[:, None]
            runner.commit(keep)
            pos = pos + torch.tensor(keep_n)
        assert not bool(runner.valid.all())  # holes exist
        other = copy.copy(runner)
        other.cache = copy.deepcopy(runner.cache)
        other._compact(int(runner.valid.sum(1).max()))
        assert other.valid.shape[1] < runner.valid.shape[1]
        nxt = torch.randint(3, 49152, (3, 2), generator=g)
        npos = pos[:, None] + torch.arange(2)
        a, _ = runner.forward(nxt, npos, torch.ones(3, 2, dtype=torch.bool))
        b, _ = other.forward(nxt, npos, torch.ones(3, 2, dtype=torch.bool))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_small_rows_linear_matches_f_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 96, bias=True)
    ref = torch.nn.Linear(48, 96, bias=True)
    ref.load_state_dict(lin.state_dict())
    assert use_small_rows_linear(lin) == 1 and use_small_rows_linear(lin) == 0  # idempotent
    for shape in [
        (1, 48),
        (1, 1, 48),
        (1, 2, 48),
        (3, 48),
        (1, 4, 48),
        (2, 3, 48),
        (7, 48),
        (3, 5, 48),
    ]:
        x = torch.randn(shape)
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(9, 48)
    assert torch.equal(lin(x), ref(x))  # many rows take F.linear itself


def test_check_drafter_for_target_names_each_mismatch():
    cfg = Eagle3Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=100, draft_vocab_size=50, target_hidden_size=24, aux_layer_ids=[1, 2, 9],
    )  # fmt: skip
    problems = check_drafter_for_target(
        cfg, vocab_size=120, hidden_size=64, num_layers=4, source="d"
    )
    # hidden_size too (eagle3.fit, issue 15): the drafter reads the target's embedding
    assert len(problems) == 4
    assert "vocab_size 100" in problems[0] and "hidden_size 32 != target hidden 64" in problems[1]
    assert "target_hidden_size 24" in problems[2] and "[1, 2, 9]" in problems[3]
    fits = dataclasses.replace(cfg, hidden_size=24)
    assert check_drafter_for_target(fits, 100, 24, 11, "d") == []  # id 9 needs >= 11 layers
    assert "[9] outside" in check_drafter_for_target(fits, 100, 24, 10, "d")[0]


# ----------------------------------------------------------------------------------------------
# Sampling: rejection sampling preserves the target's distribution

V = 8  # small vocab so the exact distribution of whole continuations can be enumerated


def small_target() -> LlamaForCausalLM:
    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # spread but position-dependent distributions
    return model


def small_drafter(target: LlamaForCausalLM) -> EagleDraft:
    """A random drafter over 6 of the 8 target tokens: q differs from p and misses two tokens."""
    cfg = Eagle3Config(
        hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        vocab_size=V, draft_vocab_size=6, target_hidden_size=32, aux_layer_ids=[0, 1, 2],
    )  # fmt: skip
    torch.manual_seed(6)
    model = Eagle3Drafter(cfg, target.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() == 2 else None
        used = torch.tensor([0, 1, 3, 4, 6, 7])
        model.d2t.copy_(used - torch.arange(6))
    return EagleDraft(model)


def exact_probs(
    target, prompt: list[int], n: int, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """P(t_1..t_n | prompt) for every continuation, shape [V]*n, by enumeration; with `top_k`,
    each step's law cut to its k likeliest tokens, then with `top_p` to the nucleus of that,
    token by token in plain Python (not the engine's code)."""
    joint = torch.ones(())
    with torch.inference_mode():
        for i in range(n):
            conts = list(itertools.product(range(V), repeat=i))
            seqs = torch.tensor([prompt + list(c) for c in conts])
            logits = target(seqs).logits[:, -1].double()
            step = torch.softmax(logits / temperature, -1)
            for row in step:  # keep the likeliest tokens until their mass reaches top_p
                ranked = sorted(range(V), key=lambda t: -float(row[t]))[: top_k or V]
                total = sum(float(row[t]) for t in ranked)
                kept, mass = [], 0.0
                for tok in ranked:
                    if mass >= top_p:
                        break
                    kept.append(tok)
                    mass += float(row[tok]) / total
                cut = torch.zeros_like(row)
                cut[kept] = row[kept] / row[kept].sum()
                row.copy_(cut)
            joint = joint[..., None] * step.reshape(*([V] * i), V)
    return joint


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, merging cells with expected count < 5 into one."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(
        sstats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    )


class FirstDrafts(EagleDraft):
    """Keeps the drafts of the first cycle: samples of the drafter's own law q."""

    def propose(self, steps, temperature, gen, top_p=1.0, top_k=0):
        drafts, q = super().propose(steps, temperature, gen, top_p, top_k)
        if not hasattr(self, "first"):
            self.first = drafts.clone()
        return drafts, q


def test_rejection_sampling_preserves_the_target_distribution():
    target = small_target()
    drafter = FirstDrafts(small_drafter(target).model)
    engine = SpecEngine(target, drafter, steps=2, stop_ids=set())
    prompt, T, n, rows = [1, 5, 2, 6], 0.8, 5, 12000
    torch.manual_seed(123)  # unseeded requests: copies of one seeded prompt would all draw alike
    out = engine.generate([prompt] * rows, GenParams(max_tokens=n, temperature=T))
    samples = torch.tensor([g.token_ids for g in out])
    assert samples.shape == (rows, n)
    accepted = sum(g.stats.accepted_drafts for g in out) / sum(
        2 * g.stats.spec_verify_ct for g in out
    )
    assert 0.15 < accepted < 0.9, accepted  # both the accept and the reject branch are exercised

    probs = exact_probs(target, prompt, n, T)
    # the joint law of the first three tokens (prefill token + one full verify cycle)
    joint3 = probs.sum(dim=(3, 4))
    counts = torch.zeros(V, V, V)
    for row in samples[:, :3].tolist():
        counts[tuple(row)] += 1
    assert chi2_pvalue(counts, joint3) > 1e-3
    # marginals of later tokens (later cycles, rows in different cycles)
    for i in (3, 4):
        marg = probs.sum(dim=tuple(d for d in range(n) if d != i))
        assert chi2_pvalue(torch.bincount(samples[:, i], minlength=V), marg) > 1e-3

    # the test has power: emitting the drafts unchecked (accept-all) would fail it
    counts = torch.zeros(V, V)
    for t1, d1 in zip(samples[:, 0].tolist(), drafter.first[:, 0].tolist(), strict=True):
        counts[t1, d1] += 1
    assert chi2_pvalue(counts, probs.sum(dim=(2, 3, 4))) < 1e-6


@pytest.mark.parametrize("top_p,top_k,bias", [(0.7, 0, False), (0.7, 0, True), (0.95, 3, False), (0.95, 3, True)])  # fmt: skip
def test_rejection_sampling_with_top_p_gives_the_targets_nucleus_law(top_p, top_k, bias, monkeypatch):  # fmt: skip
    """top_p < 1 (and top_k): the emitted tokens follow the target's cut law (exact, by
    enumeration), the drafter drafting from its own law cut the same way. Planted bias: a
    verify cycle that accepts against the uncut law fails it."""
    import serve.engine.loop as loop

    if bias:  # the cycle's acceptance ignores top_p; the prefill's draw still honours it
        real = loop.rejection_accept
        monkeypatch.setattr(loop, "rejection_accept", lambda d, q, lg, t, g, top_p=1.0, top_k=0: real(d, q, lg, t, g))  # fmt: skip
    target = small_target()
    engine = SpecEngine(target, small_drafter(target), steps=2, stop_ids=set())
    prompt, T, n, rows = [1, 5, 2, 6], 0.8, 3, 12000
    params = GenParams(max_tokens=n, temperature=T, top_p=top_p, top_k=top_k)
    torch.manual_seed(5)  # unseeded requests: copies of one seeded prompt would all draw alike
    out = engine.generate([prompt] * rows, params)
    samples = torch.tensor([g.token_ids for g in out])
    probs = exact_probs(target, prompt, n, T, top_p, top_k)
    assert (probs == 0).any()  # the nucleus leaves tokens out: the cut is exercised
    counts = torch.zeros(V, V, V)
    for row in samples.tolist():
        counts[tuple(row)] += 1
    outside = int(counts[probs == 0].sum())  # continuations the nucleus never emits
    if bias:
        assert outside > 100, outside
    else:
        assert outside == 0 and chi2_pvalue(counts, probs) > 1e-3


def test_sampled_drafts_come_from_the_drafters_law_cut_as_the_request_cuts_the_targets():
    """A chain drafts from the drafter's softmax cut by the request's top_k and top_p (q, which
    the acceptance divides by, is that cut law): no draft is spent on a token the cut law of its
    own drafter leaves out."""
    from serve.engine.drafting import pick_draft
    from serve.engine.law import sampling_probs

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 50, generator=gen)
    d, q = pick_draft(logits, 0.8, gen, 1.0, 3)
    assert (d[:, None] == logits.topk(3).indices).any(1).all() and ((q > 0).sum(-1) == 3).all()
    d, q = pick_draft(logits, 0.8, gen, 0.5, 0)
    assert torch.equal(q, sampling_probs(logits, 0.8, 0.5)) and bool(
        q.gather(1, d[:, None]).gt(0).all()
    )


def _no_residual_walk(tree, logits, steps, temperature, gen, top_p=1.0, top_k=0):
    """A planted bias: the tree walk of `tree_sample_accept` without taking a rejected child
    out of the law (each child tried at its own p(c), the bonus drawn from the whole p)."""
    from serve.engine.acceptance import sampling_probs

    probs = sampling_probs(logits, temperature, top_p, top_k)
    B = probs.shape[0]
    a, path = torch.zeros(B, dtype=torch.long), torch.zeros(B, steps, dtype=torch.long)
    bonus = torch.empty(B, dtype=torch.long)
    for b in range(B):
        kids: dict[int, list] = {}
        for i, (par, t) in enumerate(
            zip(tree.parents[b].tolist(), tree.tokens[b].tolist(), strict=True)
        ):
            kids.setdefault(par + 1, []).append((t, i + 1))
        cur = 0
        while True:
            p = probs[b, cur]
            nxt = next((n for t, n in kids.get(cur, []) if float(torch.rand(1, generator=gen)) < float(p[t])), None)  # fmt: skip
            if nxt is None:
                bonus[b] = torch.multinomial(p, 1, generator=gen)[0]
                break
            path[b, a[b]], a[b], cur = nxt, a[b] + 1, nxt
    return a, path, bonus


@pytest.mark.parametrize("top_p,top_k,bias", [(1.0, 0, False), (0.7, 0, False), (0.95, 3, False), (1.0, 0, True)])  # fmt: skip
def test_tree_sampling_gives_the_targets_law(top_p, top_k, bias, monkeypatch):
    """A draft tree at temperature > 0 (2 levels, top-2, 4 tokens): the three first tokens
    follow the target's law, nucleus included (exact, by enumeration). Planted bias: a walk
    that leaves rejected children in the law fails it."""
    import serve.engine.loop as loop

    if bias:
        monkeypatch.setattr(loop, "tree_sample_accept", _no_residual_walk)
    target = small_target()
    engine = SpecEngine(target, small_drafter(target), steps=2, topk=2, num_draft_tokens=4,
                        stop_ids=set())  # fmt: skip
    prompt, T, n, rows = [1, 5, 2, 6], 0.8, 3, 12000
    torch.manual_seed(11)  # unseeded requests: copies of one seeded prompt would all draw alike
    out = engine.generate([prompt] * rows, GenParams(max_tokens=n, temperature=T, top_p=top_p, top_k=top_k))  # fmt: skip
    hist = torch.tensor([g.stats.accept_hist for g in out]).sum(0)
    assert hist.tolist()[0] > 1000 and hist[1:].sum() > 1000, hist  # rejections and acceptances
    samples = torch.tensor([g.token_ids for g in out])
    counts = torch.zeros(V, V, V)
    for row in samples.tolist():
        counts[tuple(row)] += 1
    p = chi2_pvalue(counts, exact_probs(target, prompt, n, T, top_p, top_k))
    assert p < 1e-6 if bias else p > 1e-3, p


def test_sampling_is_reproducible_with_a_seed(target, prompts):
    engine = SpecEngine(
        target, random_drafter(target, draft_vocab_size=500, aux_layer_ids=AUX), steps=K
    )

    def sample(seed: int | None, torch_seed: int, temperature: float = 1.0) -> list:
        torch.manual_seed(torch_seed)  # the global RNG moves between calls: the seed must rule
        params = GenParams(max_tokens=8, temperature=temperature, seed=seed)
        return [g.token_ids for g in engine.generate(prompts[:3], params)]

    a = sample(7, torch_seed=0)
    assert sample(7, torch_seed=1) == a  # the seed, not the global RNG, decides
    assert sample(8, torch_seed=0) != a  # a sampler that ignores the seed gives one answer
    assert sample(7, torch_seed=0, temperature=0.0) != a  # and it does sample (not argmax)


@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
def test_a_seeded_request_draws_in_a_batch_what_it_draws_alone(target, prompts, shape):
    """Each row of a seeded batch has its own generator: a request's reply does not depend on
    its batchmates (one generator for the batch interleaved their draws)."""
    topk = 3 if shape == "tree" else 1
    engine = SpecEngine(
        target, random_drafter(target, draft_vocab_size=500, aux_layer_ids=AUX), steps=K, topk=topk
    )
    params = GenParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5, num_draft_tokens=7)
    spec = shape != "plain"
    batch = [g.token_ids for g in engine.generate(prompts[:4], params, speculative=spec)]
    alone = [engine.generate([p], params, speculative=spec)[0].token_ids for p in prompts[:4]]
    assert batch == alone


# ----------------------------------------------------------------------------------------------
# The static-cache runner (the GPU path; on CPU the same code runs without CUDA graphs)


def test_static_runner_greedy_equals_hf_generate(target, prompts, reference):
    """Chain, partial acceptance, plain decoding and a batch run one by one: all exact."""
    want = completions(reference, prompts)
    engine = SpecEngine(
        target,
        random_drafter(target, draft_vocab_size=2000, aux_layer_ids=AUX),
        steps=K,
        runner="static",
        static_capacity=64,
    )
    assert isinstance(engine.static, StaticTargetRunner) and not engine.static.use_graphs
    seen: list[tuple[int, list[int]]] = []
    got = engine.generate(
        prompts[:6], GenParams(max_tokens=N_TOK), on_tokens=lambda r, t: seen.append((r, t))
    )
    assert [g.token_ids for g in got] == want[:6]
    for req, g in enumerate(got):  # a batch runs one by one; callbacks keep the batch index
        assert sum((t for r, t in seen if r == req), []) == g.token_ids
        assert g.stats.spec_verify_ct > 0
    plain = engine.plain_generate(prompts[:3], GenParams(max_tokens=N_TOK))
    assert [g.token_ids for g in plain] == want[:3]

    hists = set()
    for req in range(5):  # one request per call: the stub maps batch rows to its refs
        oracle = OracleDraft(
            [reference[req]], lambda _r, pos, req=req: (req * 7 + pos * 3) % 5 == 0
        )
        engine.set_drafter(oracle)
        g = engine.generate([prompts[req]], GenParams(max_tokens=N_TOK))[0]
        assert g.token_ids == want[req]
        assert g.stats.spec_verify_ct == len(oracle.expected[0])
        hist = [0] * (K + 1)
        for a in oracle.expected[0]:
            hist[a] += 1
        assert g.stats.accept_hist == hist
        hists.add(tuple(hist))
    assert len(hists) > 1


def test_static_runner_tree_equals_hf_generate(target, prompts, reference):
    """Tree verify: the accepted path (not a prefix of the verified nodes) is gathered to the
    front of the cache; a wrong gather changes every later token."""
    engine = SpecEngine(target, steps=K, topk=2, runner="static")
    n = 1 + 3 * (K + 1)
    for i in range(4):
        engine.set_drafter(OracleTree([reference[i]]))
        g = engine.generate([prompts[i]], GenParams(max_tokens=n, num_draft_tokens=2 * K + 2))[0]
        assert g.token_ids == completions(reference[i : i + 1], prompts[i : i + 1], n)[0]
        assert g.stats.cycle_accept_len == K + 1
    engine.set_drafter(random_drafter(target, draft_vocab_size=2000, aux_layer_ids=AUX))
    got = engine.generate(prompts[:3], GenParams(max_tokens=N_TOK, num_draft_tokens=7))
    assert [g.token_ids for g in got] == completions(reference[:3], prompts[:3])


def test_static_runner_matches_the_eager_runner(target, prompts):
    """Logits and aux states of prefill, chain and tree forwards equal `TargetRunner`'s."""
    g = torch.Generator().manual_seed(3)
    eager, static = TargetRunner(target), StaticTargetRunner(target, capacity=64, graphs=False)
    eager.set_aux_layers([2, 0])
    static.set_aux_layers([2, 0])
    p = prompts[1]
    with torch.inference_mode():
        le, ae, _, _ = eager.prefill([p], aux=True)
        ls, as_, _, _ = static.prefill([p], aux=True)
        torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(as_, ae, rtol=1e-4, atol=1e-4)
        pos = len(p)
        for keep in ([1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]):  # prefix, tree path, all
            ids = torch.randint(3, 49152, (1, 4), generator=g)
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
            depth = torch.tensor([0, 1, 1, 2])
            vpos = (pos + depth)[None]
            ones = torch.ones(1, 4, dtype=torch.bool)
            le, ae = eager.forward(ids, vpos, ones, aux=True, tree=tree[None])
            ls, as_ = static.forward(ids, vpos, ones, aux=True, tree=tree[None])
            torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(as_, ae, rtol=1e-4, atol=1e-4)
            k = torch.tensor(keep, dtype=torch.bool)[None]
            eager.commit(k)
            static.commit(k)
            pos += int(k.sum())
        assert static.length == pos
        with pytest.raises(ValueError, match="capacity"):
            static.forward(torch.ones(1, 64, dtype=torch.long), torch.arange(64)[None], ones)


def test_static_runner_capacity_is_checked_up_front(target, prompts):
    engine = SpecEngine(target, OracleDraft([]), steps=K, runner="static", static_capacity=32)
    with pytest.raises(ValueError, match="static_capacity"):
        engine.generate([prompts[0]], GenParams(max_tokens=40))
    with pytest.raises(ValueError, match="runner="):
        SpecEngine(target, runner="fast")


def test_drafter_extends_over_the_accepted_prefix_only(target, prompts):
    """After a cycle the drafter extends over the widest accepted prefix of the batch (a + 1
    slots), not over all k + 1 slots: the rejected tail would be a drafter forward for nothing."""
    drafter = random_drafter(target, aux_layer_ids=AUX, seed=3)
    widths: list[int] = []
    extend = drafter.extend

    def recording(ids, aux, positions, write):
        widths.append(ids.shape[1])
        return extend(ids, aux, positions, write)

    drafter.extend = recording
    engine = SpecEngine(target, drafter, steps=4)
    out = engine.generate(prompts[:1], GenParams(max_tokens=12))[0]
    cycles = widths[1:]  # [0]: the prompt
    assert len(cycles) == out.stats.spec_verify_ct - 1  # the last cycle ends the request
    hist = out.stats.accept_hist  # [a] = cycles that accepted a drafts
    got = [sum(1 for w in cycles if w == a + 1) for a in range(len(hist))]
    assert all(g <= n for g, n in zip(got, hist, strict=True)) and sum(got) == len(cycles)
    assert max(cycles) < 5  # a random drafter never gets all 4 drafts accepted (k + 1 = 5)
