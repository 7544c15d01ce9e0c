"""Validation predicts decoding: the `n*alpha` that the refill chain (spd_lightning/fill_chain.py) predicts from the
teacher-forced acceptance per fill equals the decoder's measured `n*alpha` within 10 %, on a tiny target and a drafter
trained briefly on the target's own greedy answers to the very prompts it is then decoded on. And exactly: the
teacher-forced drafts at every fill (`SPDModule.every_fill`), walked as a decode walks them (`fill_chain.walk`), give
the decoder's own accepted and rejected drafts per fill, draft for draft, and its N and K, for both layouts.

Why this is a fair check: at T = 0 the decoder judges drafts of exactly the target's greedy continuation, and a draft
made at fill `k` is judged only when the `k - 1` in-flight drafts before it were accepted, i.e. were the target's own
tokens: so it sees what validation's teacher-forced view at fill `k` sees (the layouts' defining property). What
the prediction assumes and decoding does not is that acceptance depends on the fill alone, not on which positions
decoding happens to judge at which fill (hard tokens cluster; a rejection is followed by fill-1 drafts), plus the
one refill at the start of every decode. The drafter is trained so that its acceptance lies well inside (0, 1),
where those assumptions matter; a drafter that is always right or always wrong would make any prediction match.
"""

import lightning as L
import pytest
import torch
from kit import TINY_VOCAB, SyntheticChat, make_module, make_trainer
from torch.utils.data import DataLoader

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from spd_lightning.data.collate import answer_batch
from spd_lightning.fill_chain import walked_counts, walked_cycles
from spd_lightning.target import Target

N_STAGES, PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 8, 6, 40


class OwnAnswers(L.LightningDataModule):
    """The prompts and the target's greedy answers to them; the loss on the answers; every token drafted."""

    def __init__(self, sequences: list[tuple[list[int], list[int]]]):
        super().__init__()
        self.samples = [(torch.tensor(p + a), torch.arange(len(p) + len(a)) >= len(p)) for p, a in sequences]
        self.d2t = torch.arange(TINY_VOCAB)

    def train_dataloader(self):
        return DataLoader(self.samples, batch_size=4, shuffle=True, collate_fn=SyntheticChat.collate)

    def val_dataloader(self):
        return DataLoader(self.samples, batch_size=4, collate_fn=SyntheticChat.collate)


def test_the_predicted_n_alpha_matches_the_decoders(tiny_target_dir, tmp_path):
    torch.manual_seed(0)
    target = Target.load(tiny_target_dir, dtype="float32")
    prompts = [torch.randint(1, TINY_VOCAB - 1, (PROMPT_LEN,)).tolist() for _ in range(PROMPTS)]
    answers = [ar_decode(target, p, NEW_TOKENS).tokens for p in prompts]
    data = OwnAnswers(list(zip(prompts, answers)))
    module = make_module(tiny_target_dir, n=N_STAGES, lr=3e-3)
    make_trainer(tmp_path, max_steps=6).fit(module, datamodule=data)  # acceptance about 0.5 (measured)
    predicted = make_trainer(tmp_path, max_steps=1).validate(module, datamodule=data, verbose=False)[0]
    sim = Simulator(module.target, module.pdm.eval(), module.geometry)
    results = [sim.decode(p, NEW_TOKENS) for p in prompts]
    measured = N_STAGES * sum(r.N for r in results) / sum(r.K for r in results)
    assert 0.3 < predicted["val/accept_p"] < 0.8  # where the refill cost matters: not a trivial match
    assert predicted["val/predicted_n_alpha"] == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("layout,num_layers", [("type", 1), ("depth", 1), ("depth", 2)])
def test_the_walked_teacher_forced_drafts_are_the_decoders(tiny_target_dir, tmp_path, layout, num_layers):
    torch.manual_seed(0)
    target = Target.load(tiny_target_dir, dtype="float32")
    prompts = [torch.randint(1, TINY_VOCAB - 1, (PROMPT_LEN,)).tolist() for _ in range(PROMPTS)]
    data = OwnAnswers([(p, ar_decode(target, p, NEW_TOKENS).tokens) for p in prompts])
    module = make_module(tiny_target_dir, n=N_STAGES, lr=3e-3, layout=layout, num_layers=num_layers)
    make_trainer(tmp_path, max_steps=6).fit(module, datamodule=data)
    module.pdm.eval()
    sim = Simulator(module.target, module.pdm, module.geometry)
    rejected = []
    for prompt in prompts:
        decoded = sim.decode(prompt, NEW_TOKENS)
        drafts = module.every_fill(answer_batch(prompt, decoded.tokens)).answer_drafts(0).tolist()
        walked = walked_counts(drafts, N_STAGES)
        assert walked == (decoded.counters["accepted_by_fill"], decoded.counters["rejected_by_fill"])
        assert (len(drafts) + 1, walked_cycles(drafts, N_STAGES)) == (decoded.N, decoded.K)
        rejected.append(sum(walked[1]))
    assert 0 < sum(rejected) < PROMPTS * (NEW_TOKENS - 1)  # accepts and rejects: not a trivial match
