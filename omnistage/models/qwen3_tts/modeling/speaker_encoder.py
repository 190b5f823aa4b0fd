"""The Base model's speaker encoder: 24 kHz waveform -> log-mel -> ECAPA-TDNN -> x-vector.

ECAPA-TDNN after Desplanques et al., "ECAPA-TDNN: Emphasized Channel Attention, Propagation
and Aggregation in TDNN Based Speaker Verification" (Interspeech 2020): a TDNN, SE-Res2Net
blocks, multi-layer feature aggregation, attentive statistics pooling, a 1x1 conv to
``enc_dim`` (= talker hidden). Every conv pads "same" with reflection, as the checkpoint's
reference does. Mel front end (digest section 7): n_fft 1024, hop 256, Hann window 1024,
128 Slaney mels 0..12 kHz, reflect padding (n_fft - hop) / 2 each side, no centering,
magnitude ``sqrt(re^2 + im^2 + 1e-9)``, ``log(clamp(mel, 1e-5))``.

Batching: clips of different lengths are embedded one by one (:meth:`SpeakerEncoder.embed`).
Padding them into one batch would change the result (reflection padding at the clip's end,
the SE blocks' time means and the pooling statistics all see the padding), and the encoder
runs once per reference clip, so exactness wins over batching.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.qwen3_tts.modeling.config import SpeakerEncoderConfig

__all__ = ["MelFrontEnd", "SpeakerEncoder", "slaney_mel_filterbank"]

N_FFT, HOP, WIN, FMIN, FMAX = 1024, 256, 1024, 0.0, 12000.0


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    # Slaney's Auditory Toolbox scale: linear below 1 kHz (200/3 Hz per mel), log above.
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(hz >= min_log_hz, min_log_mel + torch.log(hz.clamp_min(1e-10) / min_log_hz) / logstep, hz / f_sp)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return torch.where(mel >= min_log_mel, min_log_hz * torch.exp(logstep * (mel - min_log_mel)), f_sp * mel)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """Triangular mel filters on the Slaney scale with Slaney area normalization (the
    filterbank of librosa.filters.mel's defaults): ``[n_mels, n_fft // 2 + 1] float32``,
    computed in fp64 on the CPU."""
    f64 = {"dtype": torch.float64, "device": "cpu"}
    fft_hz = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, **f64)
    lo, hi = _hz_to_slaney_mel(torch.tensor([fmin, fmax], **f64)).tolist()
    edges = _slaney_mel_to_hz(torch.linspace(lo, hi, n_mels + 2, **f64))
    widths = edges.diff()
    ramps = edges[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    filters = torch.minimum(rising, falling).clamp_min(0.0)
    filters = filters * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return filters.float()


class MelFrontEnd(nn.Module):
    """Waveform ``[B, S] float32`` (24 kHz, in [-1, 1]) -> log-mel ``[B, T, mel_dim]`` with
    ``T = (S + 2 * 384 - 1024) // 256 + 1`` frames (fp32). Raises: RuntimeError from the
    reflection pad when ``S <= 384``."""

    def __init__(self, sample_rate: int, n_mels: int) -> None:
        super().__init__()
        self.sample_rate, self.n_mels = sample_rate, n_mels
        self.register_buffer("filters", torch.empty(0), persistent=False)
        self.register_buffer("window", torch.empty(0), persistent=False)
        self.reset_buffers("cpu")

    def reset_buffers(self, device: torch.device | str) -> None:
        """(Re)build the fp32 filterbank and window on ``device`` (they are not in
        checkpoints; a meta-device load calls this)."""
        self.filters = slaney_mel_filterbank(self.sample_rate, N_FFT, self.n_mels, FMIN, FMAX).to(device)
        self.window = torch.hann_window(WIN, device=device)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        pad = (N_FFT - HOP) // 2
        wav = F.pad(wav.float()[:, None], (pad, pad), mode="reflect")[:, 0]
        spec = torch.stft(wav, N_FFT, hop_length=HOP, win_length=WIN, window=self.window, center=False, return_complex=True)
        magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
        mel = torch.matmul(self.filters, magnitude)
        return torch.log(mel.clamp_min(1e-5)).transpose(1, 2)


def _conv(in_ch: int, out_ch: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    """Conv1d ("same", reflect) + ReLU."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(in_ch, out_ch, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Split channels into ``scale`` parts; part 0 passes, part i > 0 goes through a TDNN
    after adding the previous part's output (hierarchical residual, Gao et al. 2019)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        previous = None
        for block, part in zip(self.blocks, parts[1:], strict=True):
            previous = block(part if previous is None else part + previous)
            out.append(previous)
        return torch.cat(out, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """Channel gates from the time mean: ``x * sigmoid(conv2(relu(conv1(mean_t x))))``."""

    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """TDNN(1x1) -> Res2Net -> TDNN(1x1) -> SE, plus the input (residual)."""

    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(out_ch, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_ch, out_ch, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_ch, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean[:, :, None]).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp_min(1e-12))


class AttentiveStatisticsPooling(nn.Module):
    """Attention over time conditioned on the global mean/std; returns the attention-weighted
    mean and std concatenated: ``[B, C, T] -> [B, 2C, 1]``."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[2]
        uniform = torch.full_like(x[:, :1], 1.0 / t)
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat((x, mean[:, :, None].expand(-1, -1, t), std[:, :, None].expand(-1, -1, t)), dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat((mean, std), dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector extractor (checkpoint prefix ``speaker_encoder``).

    Parameter names follow the checkpoint: ``blocks.0`` (TDNN), ``blocks.1..`` (SE-Res2Net),
    ``mfa``, ``asp``, ``fc``.
    """

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.sample_rate = config.sample_rate
        self.mel = MelFrontEnd(config.sample_rate, config.mel_dim)
        self.blocks = nn.ModuleList([TimeDelayNetBlock(config.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], config.enc_res2net_scale, config.enc_se_channels, ks[i], dil[i])
            )
        # the aggregation's input is the concatenation of blocks 1..; the checkpoint sizes it
        # enc_channels[-1] (1536 = 3 x 512), so configs must keep the two equal
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], config.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, config.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mels ``[B, T, mel_dim]`` (equal lengths) -> x-vectors ``[B, enc_dim]`` in the
        module's dtype."""
        x = mels.to(self.fc.weight.dtype).transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x))[:, :, 0]

    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """One clip: ``wav [S] float32`` mono at ``sample_rate`` (24 kHz; resample before)
        -> x-vector ``[enc_dim]``. The mel runs in fp32, the encoder in the module's dtype.

        Raises:
            ValueError: ``wav`` is not 1-D or too short for one mel frame (<= 384 samples).
        """
        if wav.dim() != 1 or wav.shape[0] <= (N_FFT - HOP) // 2:
            raise ValueError(f"need a mono clip of more than {(N_FFT - HOP) // 2} samples, got shape {tuple(wav.shape)}")
        return self(self.mel(wav[None]))[0]
