"""A DeepSpeed training script of the kind a team ships, small enough for this CPU: a small
decoder (plain torch: embedding, 4 causal pre-norm transformer layers, LM head, random weights),
synthetic tokens, ``deepspeed.initialize`` with the config autotune's ``deepspeed`` preset writes, and the
engine's own throughput-timer and progress lines, which the preset reads.

    autotune run examples/deepspeed_cpu/deepspeed_cpu.yaml

Run by the preset as ``torchrun --standalone --nproc-per-node N train.py --deepspeed_config
<trial>/deepspeed_config.json --steps K``; on CPU DeepSpeed's accelerator is ``cpu`` and its
collectives go over gloo (``DS_ACCELERATOR=cpu`` in the spec's env).
"""

import argparse
import os

import deepspeed
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--steps", type=int, default=int(os.environ.get("AUTOTUNE_ITERATIONS", "5")))
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
args = p.parse_args()


class Decoder(nn.Module):
    def __init__(self, vocab: int = 2048, dim: int = 256, layers: int = 4, heads: int = 8, ffn: int = 688):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        logits = self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


# DeepSpeed's own logger (and its handler) start at WARNING: its throughput-timer and progress
# lines, what the preset reads, are INFO
deepspeed.utils.logging.set_log_level_from_string("info")
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = Decoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=args.deepspeed_config)
micro = engine.train_micro_batch_size_per_gpu()
generator = torch.Generator().manual_seed(engine.global_rank)
for step in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 2048, (micro, args.seq_len), generator=generator)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # a clean exit: gloo torn down before the interpreter
