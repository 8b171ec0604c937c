"""Small real architectures for the sharding-plan benchmark and tests: HF GPT-2, Llama, T5, BERT, ViT (tiny configs,
built offline) and two hand-written CNNs shaped like timm's ConvNeXt and torchvision's ResNet (torchvision and timm
cannot be imported with this CPU torch). Each is a plain LightningModule with ``batch(n, seed)`` for its data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, DEPTH = 256, 32, 64, 4


class Arch(pl.LightningModule):
    """``self.model`` and a loss; SGD so that the step time is the model's, not the optimizer's."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class HFCausal(Arch):
    def __init__(self, config: Any, cls: Any) -> None:
        super().__init__()
        self.model = cls(config)

    def batch(self, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed)),)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss


class T5(HFCausal):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids.flip(-1)).loss


class BertMLM(HFCausal):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        masked = ids.clone()
        masked[:, ::4] = 3  # a fixed "[MASK]" every fourth token
        return self.model(input_ids=masked, labels=ids).loss


class Classifier(Arch):
    """An image model (``self.model``) with a linear head, trained on random 32x32 images."""

    def __init__(self, model: nn.Module, features: int, classes: int = 10) -> None:
        super().__init__()
        self.model = model
        self.head = nn.Linear(features, classes)

    def batch(self, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.features(x)), y)


class ViT(Classifier):
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).pooler_output


# -- ConvNeXt-like (timm's layout: stem, stages of [downsample, blocks], head) ----------------------------------------
class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor, as timm writes it (its output is a permuted view)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv_dw(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtStage(nn.Module):
    def __init__(self, in_dim: int, dim: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Identity() if in_dim == dim else nn.Sequential(LayerNorm2d(in_dim), nn.Conv2d(in_dim, dim, 2, stride=2))
        self.blocks = nn.Sequential(*(ConvNeXtBlock(dim) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (16, 32, 64, 128), depths: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        self.stages = nn.Sequential(*(ConvNeXtStage(dims[max(i - 1, 0)], d, n) for i, (d, n) in enumerate(zip(dims, depths))))
        self.norm = nn.LayerNorm(dims[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.stages(self.stem(x)).mean((2, 3)))


# -- ResNet-like (torchvision's layout: stem, layer1..layer4 of Bottlenecks with a conv+BN downsample) ----------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_dim: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(in_dim, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or in_dim != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_dim, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), depths: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0])
        in_dim = widths[0]
        for i, (w, n) in enumerate(zip(widths, depths)):
            layer = [Bottleneck(in_dim, w, 1 if i == 0 else 2)] + [Bottleneck(w * 4, w) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*layer))
            in_dim = w * 4
        self.out_dim = in_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return x.mean((2, 3))


# -- the zoo --------------------------------------------------------------------------------------------------------
def gpt2() -> Arch:
    from transformers import GPT2Config, GPT2LMHeadModel

    return HFCausal(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=DEPTH, n_head=4), GPT2LMHeadModel)


def llama() -> Arch:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return HFCausal(config, LlamaForCausalLM)


def t5() -> Arch:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=4 * WIDTH, num_layers=DEPTH, num_heads=4, decoder_start_token_id=0)
    return T5(config, T5ForConditionalGeneration)


def bert() -> Arch:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        intermediate_size=4 * WIDTH,
        max_position_embeddings=SEQ,
    )
    return BertMLM(config, BertForMaskedLM)


def vit() -> Arch:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=4, intermediate_size=4 * WIDTH)
    return ViT(ViTModel(config), WIDTH)


def convnext() -> Arch:
    return Classifier(ConvNeXt(), 128)


def resnet() -> Arch:
    net = ResNet()
    return Classifier(net, net.out_dim)


ARCHS: dict[str, Callable[[], Arch]] = {
    "gpt2": gpt2,
    "llama": llama,
    "t5": t5,
    "bert": bert,
    "vit": vit,
    "convnext": convnext,
    "resnet": resnet,
}
