"""Tiny vision / audio / state-space / recurrent models for the torch vision matrix.

Each builder returns ``(model, inputs)`` with ``inputs`` as ``capture`` takes them (one mapping
means keyword arguments). Sizes are the smallest that keep every block of the family.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH = 8


def resnet() -> tuple:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
                          depths=[1, 1], layer_type="basic", num_labels=4)  # fmt: skip
    return ResNetForImageClassification(config), _images()


def vit() -> tuple:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                       num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                       num_labels=4)  # fmt: skip
    return ViTForImageClassification(config), _images()


def convnext() -> tuple:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                            patch_size=2, num_labels=4)  # fmt: skip
    return ConvNextForImageClassification(config), _images()


def _images() -> tuple:
    pixels = torch.randn(BATCH, 3, 16, 16)
    return ({"pixel_values": pixels, "labels": torch.randint(0, 4, (BATCH,))},)


def whisper() -> tuple:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=32,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    features = torch.randn(BATCH, 8, 16)
    labels = torch.randint(3, 64, (BATCH, 6))
    decoder_ids = torch.randint(3, 64, (BATCH, 6))
    inputs = {"input_features": features, "labels": labels, "decoder_input_ids": decoder_ids}
    return WhisperForConditionalGeneration(config), (inputs,)


def mamba() -> tuple:
    """HF's slow path (no ``mamba_ssm`` kernels): depthwise conv1d, softplus, selective scan."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1,
                         expand=2, conv_kernel=4, use_mambapy=False)  # fmt: skip
    ids = torch.randint(0, 64, (BATCH, 8))
    return MambaForCausalLM(config), ({"input_ids": ids, "labels": ids},)


def unet() -> tuple:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
        layers_per_block=1, cross_attention_dim=16, norm_num_groups=4, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), mid_block_type=None,
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    sample, context = torch.randn(BATCH, 4, 8, 8), torch.randn(BATCH, 4, 16)
    return model, (sample, torch.tensor(10), context)


def wav2vec2() -> tuple:
    """HF Wav2Vec2 (the base model: its CTC head checks ``labels.max()`` in Python, which a
    fake-tensor trace cannot): a 1-D conv feature encoder on raw audio (group norm on the first
    layer, GELU), a grouped positional convolution with weight norm, a transformer encoder."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
    )  # fmt: skip
    return Wav2Vec2Model(config), (torch.randn(BATCH, 400),)


class Recurrent(nn.Module):
    """A 2-layer batch-first LSTM or GRU and a linear head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.head(y)


def lstm() -> tuple:
    return Recurrent("LSTM"), (torch.randn(BATCH, 5, 16),)


def gru() -> tuple:
    return Recurrent("GRU"), (torch.randn(BATCH, 5, 16),)


class Activations(nn.Module):
    """Batch norm (training mode) and group norm around the activations without a DTensor
    backward (hardswish, hardsigmoid, softplus, mish, elu, leaky_relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.gn = nn.GroupNorm(4, 8)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = nn.functional
        h = F.hardswish(self.bn(self.fc1(x)))
        h = self.gn(h.view(-1, 8, 4))
        h = F.softplus(h) + F.mish(h) + F.elu(h) + F.leaky_relu(h, 0.1) + F.hardsigmoid(h)
        return self.fc2(h.flatten(1))


def activations() -> tuple:
    return Activations(), (torch.randn(BATCH, 16),)


def swin() -> tuple:
    """HF Swin: window partition and reverse (views of a transposed activation), relative
    position bias, patch merging, the ``adaptive_avg_pool1d`` pooler (a channels-last
    ``as_strided_`` on CPU). No stochastic depth (its random drops differ between runs)."""
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                        num_heads=[2, 2], window_size=2, num_labels=10,
                        drop_path_rate=0.0)  # fmt: skip
    pixels = torch.randn(BATCH, 3, 32, 32)
    return SwinForImageClassification(config), (
        {"pixel_values": pixels, "labels": torch.randint(0, 10, (BATCH,))},
    )


FAMILIES = {
    "resnet": resnet, "vit": vit, "convnext": convnext, "whisper": whisper, "mamba": mamba,
    "unet": unet, "lstm": lstm, "gru": gru, "activations": activations, "wav2vec2": wav2vec2,
    "swin": swin,
}  # fmt: skip
