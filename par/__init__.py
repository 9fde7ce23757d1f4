"""par: parallel training, written out so it can be read aloud.

One concept per module: `dist` (bootstrap), `launch` (notebook launcher),
`collectives` (hand-written ring ops), `commlog` (bytes counted), `model`
(GPT-lite), `data` (character corpus), `memory` (accounting), and one module per
parallel strategy.
"""
__version__ = "0.1.0"
