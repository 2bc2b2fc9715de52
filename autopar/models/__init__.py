"""Built-in model families and the model spec registry.

    bundle = build_model("gpt3-175b")                    # on meta: any size builds in seconds
    bundle = build_model("gpt:layers=4", device="cpu", seed=0)
    bundle = build_model("examples/my_model.py:make_model")
    loss = bundle.loss_fn(bundle.model(*bundle.example_inputs), bundle.example_targets)

Families: gpt, llama, bert, vit, mlp, moe (one file each, moe with its layer, attention and
GShard files); named sizes such as gpt3-175b, llama3-8b, mixtral-8x7b, deepseek-v3, bert-base,
vit-b16 and tiny-<family> aliases for the family defaults. The spec
grammar is in `autopar.models.spec`. On meta the weight initializers are skipped
(`on_meta()`, meta_build.py: the same for a model of your own, e.g. `from_config`). Every model keeps its repeated blocks in an
`nn.ModuleList` named `layers`, takes inputs with the batch as dim 0 and exports with
`torch.export` under a dynamic batch (`batch_dynamic_shapes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from autopar.errors import ModelSpecError
from autopar.validation import MAX_GLOBAL_BATCH, shorten
from autopar.models import bert, gpt, llama, mlp, moe, vit
from autopar.models.meta_build import on_meta, skip_init_on_meta
from autopar.models.spec import (
    call_factory,
    did_you_mean,
    field_types,
    format_overrides,
    format_value,
    import_factory,
    make_config,
    parse_spec,
)

__all__ = [
    "FAMILIES",
    "NAMED_SIZES",
    "Family",
    "ModelBundle",
    "NamedSize",
    "ResolvedSpec",
    "batch_dynamic_shapes",
    "build_model",
    "list_models",
    "on_meta",
    "resolve_spec",
    "skip_init_on_meta",
]


@dataclass(frozen=True, kw_only=True)
class ModelBundle:
    """A built model with what planning and training need besides it."""

    name: str  # canonical spec, e.g. "gpt:layers=2,hidden=64,..." or "gpt3-175b"
    model: nn.Module
    example_inputs: tuple  # positional inputs for model(*example_inputs); batch is dim 0
    example_targets: torch.Tensor | None
    loss_fn: Callable | None  # loss_fn(model(*inputs), targets) -> scalar
    config: object | None  # the family config dataclass (None for file factories)


@dataclass(frozen=True, kw_only=True)
class Family:
    """A built-in model family: config, module and training pieces from one file."""

    name: str  # registry name, e.g. "gpt"
    description: str  # one line for `list_models`
    config_cls: type  # frozen keyword-only config dataclass; its defaults are a tiny model
    model_cls: Callable[..., nn.Module]  # built as model_cls(config): a class, or a function choosing one
    module: ModuleType  # the family file: example_inputs, example_targets, loss_fn, NAMED_SIZES


@dataclass(frozen=True, kw_only=True)
class NamedSize:
    """A published model shape: a family plus field values."""

    name: str  # registry name, e.g. "gpt3-175b"
    family: str  # family name
    values: Mapping[str, object]  # config fields that differ from the family defaults


@dataclass(frozen=True, kw_only=True)
class ResolvedSpec:
    """A spec string checked against the registry; nothing built yet."""

    name: str  # canonical spec
    family: Family | None = None  # None for file specs
    config: object | None = None  # the family config with overrides applied
    file: str | None = None  # path of a file spec
    factory: str | None = None  # factory name of a file spec


def _family(module: ModuleType, config_cls: type, model_cls: Callable[..., nn.Module], description: str) -> Family:
    return Family(
        name=config_cls.family, description=description, config_cls=config_cls, model_cls=model_cls, module=module
    )


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        _family(gpt, gpt.GPTConfig, gpt.GPT, "GPT (Megatron-LM): learned positions, pre-LN, tied embedding"),
        _family(llama, llama.LlamaConfig, llama.Llama, "LLaMA: RMSNorm, rotary, grouped-query attention, SwiGLU"),
        _family(bert, bert.BertConfig, bert.Bert, "BERT encoder, post-LN, MLM head tied to the word embedding"),
        _family(vit, vit.ViTConfig, vit.ViT, "Vision Transformer: conv patches, class token, pre-LN, class head"),
        _family(mlp, mlp.MLPConfig, mlp.MLP, "plain residual MLP regressor (Linear+GELU blocks)"),
        _family(moe, moe.MoEConfig, moe.build, "mixture of experts (Mixtral, Qwen3, DeepSeek-V3): GQA or MLA, "
                "routed grouped-mm SwiGLU experts, shared experts; router=gshard: GShard GPT"),
    )
}


def _named_sizes() -> dict[str, NamedSize]:
    sizes = {f"tiny-{name}": NamedSize(name=f"tiny-{name}", family=name, values={}) for name in FAMILIES}
    for family in FAMILIES.values():
        for name, values in family.module.NAMED_SIZES.items():
            sizes[name] = NamedSize(name=name, family=family.name, values=values)
    return sizes


NAMED_SIZES: dict[str, NamedSize] = _named_sizes()


def list_models() -> dict[str, str]:
    """Registry name -> one-line description: the families, then the named sizes."""
    models = {name: family.description for name, family in FAMILIES.items()}
    for size in NAMED_SIZES.values():
        fields = field_types(FAMILIES[size.family].config_cls)
        shape = ", ".join(f"{key}={format_value(size.values[key])}" for key in fields if key in size.values)
        models[size.name] = f"{size.family}: {shape}" if shape else f"{size.family} with its tiny defaults"
    return models


def resolve_spec(spec: str) -> ResolvedSpec:
    """Parses a spec and applies its overrides to the family config; raises ModelSpecError."""
    parsed = parse_spec(spec)
    if parsed.is_file:
        return ResolvedSpec(name=f"{parsed.name}:{parsed.factory}", file=parsed.name, factory=parsed.factory)
    if parsed.name in FAMILIES:
        family = FAMILIES[parsed.name]
        config = make_config(family.config_cls, {}, parsed.overrides)
        return ResolvedSpec(name=f"{family.name}:{format_overrides(config)}", family=family, config=config)
    if parsed.name in NAMED_SIZES:
        size = NAMED_SIZES[parsed.name]
        family = FAMILIES[size.family]
        published = family.config_cls(**size.values)
        config = make_config(family.config_cls, size.values, parsed.overrides)
        changed = [key for key, _ in parsed.overrides if getattr(config, key) != getattr(published, key)]
        name = f"{size.name}:{format_overrides(config, only=changed)}" if changed else size.name
        return ResolvedSpec(name=name, family=family, config=config)
    known = [*FAMILIES, *NAMED_SIZES]
    raise ModelSpecError(
        f"unknown model '{parsed.name}'{did_you_mean(parsed.name, known) or '.'} Known: {', '.join(known)}; "
        "or give a file as 'path/to/model.py:factory'"
    )


def build_model(
    spec: str, *, batch_size: int = 2, device: str | torch.device = "meta", seed: int | None = None
) -> ModelBundle:
    """Builds the model named by `spec` on `device` (meta by default: nothing is allocated).

    `batch_size` sets dim 0 of the example inputs and targets (keep it >= 2 when exporting with a
    dynamic batch: torch.export specializes a size-1 dim). With `seed` and a real device, the
    global RNG is seeded first, so every rank builds identical weights and inputs. A file
    factory is called with `device` as the default device and decides its own batch size.
    """
    resolved = resolve_spec(spec)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ModelSpecError(f"batch_size must be a positive int, got {shorten(batch_size)}")
    if batch_size > MAX_GLOBAL_BATCH:
        raise ModelSpecError(f"batch_size must be at most {MAX_GLOBAL_BATCH:,}, got {batch_size:,}")
    device = _parse_device(device)
    if seed is not None and device.type != "meta":
        torch.manual_seed(seed)
    if resolved.family is None:
        return _build_from_file(resolved, device)
    family, config = resolved.family, resolved.config
    with torch.device(device), _no_init_on(device):
        model = family.model_cls(config)
    return ModelBundle(
        name=resolved.name,
        model=model,
        example_inputs=family.module.example_inputs(config, batch_size, device),
        example_targets=family.module.example_targets(config, batch_size, device),
        loss_fn=family.module.loss_fn,
        config=config,
    )


def _build_from_file(resolved: ResolvedSpec, device: torch.device) -> ModelBundle:
    factory = import_factory(resolved.file, resolved.factory)
    with torch.device(device), _no_init_on(device):
        result = call_factory(factory, f"'{resolved.factory}' in '{resolved.file}'")
    return ModelBundle(
        name=resolved.name,
        model=result.model,
        example_inputs=result.example_inputs,
        example_targets=result.example_targets,
        loss_fn=result.loss_fn,
        config=None,
    )


def _no_init_on(device: torch.device):
    """On meta, weight initializers do nothing (there are no values to set): meta_build.py."""
    return skip_init_on_meta() if device.type == "meta" else contextlib.nullcontext()


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelSpecError(
            f"device {device!r} is not a torch device; use e.g. 'meta', 'cpu' or 'cuda:0'"
        ) from exc


def batch_dynamic_shapes(example_inputs: tuple) -> tuple[dict[int, torch.export.Dim] | None, ...]:
    """`dynamic_shapes` for torch.export: dim 0 of every tensor input is one shared "batch" dim."""
    batch = torch.export.Dim("batch")
    return tuple({0: batch} if isinstance(value, torch.Tensor) else None for value in example_inputs)
