"""The EAGLE-3 baseline drafter (docs/EAGLE3.md): the model, its training-time test, its Lightning module, its export.

model.py    `Eagle3Drafter`: fuses low/middle/high target states, one decoder layer, a draft-vocabulary head
ttt.py      training-time test: the drafter unrolled over its own predictions with the right attention mask
module.py   `Eagle3Module`: online distillation from the frozen target (`fit --model Eagle3Module`)
export.py   the drafter directory `inference/` loads (`KIND`, `save_eagle3`, `load_eagle3`)
"""
