"""One rank of a 2-process job that parallelizes a tiny Gemma 3 (sliding and full attention
layers) with autopar.parallelize, as a user's torchrun script does: rank 0 plans, every rank
captures the model, in processes whose string hashes differ. Prints the losses of 2 steps and
one process's."""

import copy
import json

import torch
import torch.nn.functional as F
import transformers

import autopar

config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                       max_position_embeddings=16, layer_types=["sliding_attention", "full_attention"])
torch.manual_seed(0)
model = transformers.Gemma3ForCausalLM(config)
generator = torch.Generator().manual_seed(1)
tokens, targets = torch.randint(0, 64, (2, 8), generator=generator), torch.randint(0, 64, (2, 8), generator=generator)


def loss_fn(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


reference, expected = copy.deepcopy(model), []
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for _ in range(2):
    loss = loss_fn(reference(input_ids=tokens), targets)
    loss.backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
    expected.append(loss.item())

pm = autopar.parallelize(model, "cpu:procs=2", dict(input_ids=tokens), loss_fn=loss_fn, example_targets=targets,
                         constraints=dict(dp=1, tp=2, pp=1), precision="fp32")
optimizer = torch.optim.SGD(pm.parameters(), lr=0.1)
losses = []
for _ in range(2):
    losses.append(pm.train_step(dict(input_ids=tokens), targets).item())
    optimizer.step()
    optimizer.zero_grad()
print("LOSSES " + json.dumps([losses, expected]))
