"""The model zoo: standard architectures with tiny random configs, built from
their own libraries (transformers model classes, torch.nn) and exported the
way their users export them.

Each row is one architecture. Dynamic dimensions start at 1 (`Dim(min=1)`) so
that the runs at batch or length 1 prove the user's range is honoured.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.export import Dim

from .runner import Case, ZooModel

BATCH = Dim("batch", min=1, max=8)
SEQ = Dim("seq", min=1, max=32)
VOCAB = 96
LM_DTYPES = (torch.float32, torch.bfloat16)


def _hf(model_cls: str, config_cls: str, dtype: torch.dtype, **config: Any) -> nn.Module:
    import transformers

    attn = config.pop("attn", None)  # else the model's default (SDPA where it has it)
    cfg = getattr(transformers, config_cls)(**config)
    if attn:
        cfg._attn_implementation = attn
    return getattr(transformers, model_cls)(cfg).eval().to(dtype)


def _ids(batch: int, seq: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq))


def text(model_cls: str, config_cls: str, *, mask: bool = True, dynamic_seq: bool = True,
         **config: Any) -> Callable[[], Case]:
    """An encoder over token ids (and an attention mask with padding in the second run)."""

    def build(dtype: torch.dtype) -> Case:
        module = _hf(model_cls, config_cls, dtype, **config)

        def inputs(batch: int, seq: int, pad: int = 0) -> dict[str, Any]:
            out = {"input_ids": _ids(batch, seq)}
            if mask:
                m = torch.ones(batch, seq, dtype=torch.long)
                m[-1, seq - pad:] = 0
                out["attention_mask"] = m
            return out

        dims = {0: BATCH, 1: SEQ} if dynamic_seq else {0: BATCH}
        shapes = {k: dims for k in inputs(1, 1)}
        runs = [inputs(1, 5 if dynamic_seq else 8), inputs(3, 11 if dynamic_seq else 8, pad=2)]
        return Case(module, inputs(2, 8), runs, shapes)

    return build


def decoder(model_cls: str, config_cls: str, **config: Any) -> Callable[[], Case]:
    """A causal LM over token ids, no cache (the prefill graph), dynamic batch and length."""
    config = dict(vocab_size=VOCAB, use_cache=False, **config)

    def build(dtype: torch.dtype) -> Case:
        module = _hf(model_cls, config_cls, dtype, **config)
        shapes = {"input_ids": {0: BATCH, 1: SEQ}}
        return Case(module, {"input_ids": _ids(2, 8)}, [{"input_ids": _ids(1, 1)}, {"input_ids": _ids(2, 13)}],
                    shapes)

    return build


def seq2seq(model_cls: str, config_cls: str, **config: Any) -> Callable[[], Case]:
    """An encoder-decoder over source and target ids (teacher forcing, no cache)."""
    config = dict(vocab_size=VOCAB, use_cache=False, **config)

    def build(dtype: torch.dtype) -> Case:
        module = _hf(model_cls, config_cls, dtype, **config)

        def inputs(batch: int, src: int, tgt: int) -> dict[str, Any]:
            return {"input_ids": _ids(batch, src), "decoder_input_ids": _ids(batch, tgt)}

        src, tgt = Dim("src", min=1, max=32), Dim("tgt", min=1, max=32)
        shapes = {"input_ids": {0: BATCH, 1: src}, "decoder_input_ids": {0: BATCH, 1: tgt}}
        return Case(module, inputs(2, 9, 6), [inputs(1, 4, 1), inputs(3, 12, 7)], shapes)

    return build


def _lively(module: nn.Module) -> nn.Module:
    """torch's default init for convolutions and random batch-norm statistics: the small init
    some configs use makes a deep random conv stack's output vanish (nothing left to compare)."""
    g = torch.Generator().manual_seed(0)
    for m in module.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            m.reset_parameters()
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return module


def image(model_cls: str, config_cls: str, size: int = 32, channels: int = 3, **config: Any) -> Callable[[], Case]:
    """A vision model over a batch of images."""

    def build(dtype: torch.dtype) -> Case:
        module = _lively(_hf(model_cls, config_cls, torch.float32, **config)).to(dtype)

        def inputs(batch: int) -> dict[str, Any]:
            return {"pixel_values": torch.randn(batch, channels, size, size, dtype=dtype)}

        return Case(module, inputs(2), [inputs(1), inputs(3)], {"pixel_values": {0: BATCH}})

    return build


def audio(model_cls: str, config_cls: str, key: str = "input_values", shape: tuple[int, ...] = (1600,),
          **config: Any) -> Callable[[], Case]:
    """A speech model over raw samples or features."""

    def build(dtype: torch.dtype) -> Case:
        module = _hf(model_cls, config_cls, dtype, **config)

        def inputs(batch: int) -> dict[str, Any]:
            return {key: torch.randn(batch, *shape, dtype=dtype)}

        return Case(module, inputs(2), [inputs(1), inputs(3)], {key: {0: BATCH}})

    return build


def static_cache_lm(model_cls: str, config_cls: str, **config: Any) -> Callable[[], Case]:
    """transformers' ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`: static or hybrid
    cache as module buffers), exported strict as its docs show; the runs are successive decode steps
    checked against the model without a cache."""

    def build(dtype: torch.dtype) -> Case:
        from transformers import GenerationConfig
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        model = _hf(model_cls, config_cls, dtype, vocab_size=VOCAB, use_cache=True, **config)
        model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
        recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=16)
        tokens = _ids(1, 4)
        runs = [{"input_ids": tokens[:, i:i + 1], "cache_position": torch.tensor([i])} for i in range(4)]

        def without_cache(run: dict[str, Any]) -> torch.Tensor:
            # The same position answered from the whole sequence so far, with no cache:
            # the lowered cache is checked, not assumed.
            end = int(run["cache_position"][0]) + 1
            return model(input_ids=tokens[:, :end], use_cache=False).logits[:, -1:]

        # `recipe.export()` exports its inner static/hybrid-cache module, strict: so does the zoo.
        return Case(recipe.model, runs[0], runs, None, reference=without_cache)

    return build


def torch_module(make: Callable[[], nn.Module], **inputs: Callable[[int], torch.Tensor]) -> Callable[[], Case]:
    """A torch.nn building block over batch-first inputs, dynamic batch."""

    def build(dtype: torch.dtype) -> Case:
        module = make().eval().to(dtype)

        def at(batch: int) -> dict[str, Any]:
            return {k: f(batch).to(dtype) for k, f in inputs.items()}

        return Case(module, at(2), [at(1), at(3)], {k: {0: BATCH} for k in inputs})

    return build


def _whisper(dtype: torch.dtype) -> Case:
    cfg = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
               max_source_positions=16, max_target_positions=32, use_cache=False, decoder_start_token_id=1,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None)
    module = _hf("WhisperForConditionalGeneration", "WhisperConfig", dtype, **cfg)

    def inputs(batch: int, tgt: int) -> dict[str, Any]:
        return {"input_features": torch.randn(batch, 16, 32, dtype=dtype), "decoder_input_ids": _ids(batch, tgt)}

    shapes = {"input_features": {0: BATCH}, "decoder_input_ids": {0: BATCH, 1: Dim("tgt", min=1, max=32)}}
    return Case(module, inputs(2, 5), [inputs(1, 1), inputs(3, 7)], shapes)


def _parakeet(dtype: torch.dtype) -> Case:
    from transformers import ParakeetCTCConfig, ParakeetEncoderConfig, ParakeetForCTC

    enc = ParakeetEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                subsampling_conv_channels=8, num_mel_bins=16, dropout=0.0, attention_dropout=0.0,
                                activation_dropout=0.0, layerdrop=0.0)
    module = ParakeetForCTC(ParakeetCTCConfig(encoder_config=enc.to_dict(), vocab_size=VOCAB)).eval().to(dtype)

    def inputs(batch: int, frames: int) -> dict[str, Any]:
        return {"input_features": torch.randn(batch, frames, 16, dtype=dtype)}

    k = Dim("k", min=2, max=16)  # the subsampling stack exports frame counts of the form 8k - 4
    shapes = {"input_features": {0: BATCH, 1: 8 * k - 4}}
    return Case(module, inputs(2, 36), [inputs(1, 12), inputs(2, 60)], shapes)


TINY_LM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
TINY_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64)
TINY_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64)
TINY_W2V = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4, vocab_size=VOCAB)
TINY_MOE = dict(TINY_LM, num_local_experts=4, num_experts_per_tok=2)

MODELS: list[ZooModel] = [
    # ------------------------------------------------------------ text encoders
    ZooModel("bert", "text encoder", "transformers BertModel", text("BertModel", "BertConfig", **TINY_BERT)),
    ZooModel("bert-eager", "text encoder", "transformers BertModel, attn_implementation='eager'",
             text("BertModel", "BertConfig", **TINY_BERT, attn="eager")),
    ZooModel("distilbert", "text encoder", "transformers DistilBertModel",
             text("DistilBertModel", "DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4,
                  hidden_dim=64, max_position_embeddings=64)),
    ZooModel("roberta", "text encoder", "transformers RobertaModel",
             text("RobertaModel", "RobertaConfig", **TINY_BERT, pad_token_id=1)),
    ZooModel("albert", "text encoder", "transformers AlbertModel",
             text("AlbertModel", "AlbertConfig", **TINY_BERT, embedding_size=16)),
    ZooModel("electra", "text encoder", "transformers ElectraModel",
             text("ElectraModel", "ElectraConfig", **TINY_BERT, embedding_size=16)),
    ZooModel("deberta-v2", "text encoder", "transformers DebertaV2Model",
             text("DebertaV2Model", "DebertaV2Config", **TINY_BERT, attn="eager")),
    ZooModel("modernbert", "text encoder", "transformers ModernBertModel",
             text("ModernBertModel", "ModernBertConfig", **TINY_BERT, global_attn_every_n_layers=2, pad_token_id=0,
                  local_attention=8)),
    ZooModel("t5-encoder", "text encoder", "transformers T5EncoderModel",
             text("T5EncoderModel", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_heads=4)),
    ZooModel("clip-text", "text encoder", "transformers CLIPTextModel",
             text("CLIPTextModel", "CLIPTextConfig", **TINY_BERT)),
    # ------------------------------------------------------------ decoder LMs
    ZooModel("llama", "decoder LM", "transformers LlamaForCausalLM",
             decoder("LlamaForCausalLM", "LlamaConfig", **TINY_LM), dtypes=LM_DTYPES),
    ZooModel("llama-eager", "decoder LM", "transformers LlamaForCausalLM, attn_implementation='eager'",
             decoder("LlamaForCausalLM", "LlamaConfig", **TINY_LM, attn="eager"), dtypes=LM_DTYPES),
    ZooModel("qwen2", "decoder LM", "transformers Qwen2ForCausalLM",
             decoder("Qwen2ForCausalLM", "Qwen2Config", **TINY_LM), dtypes=LM_DTYPES),
    ZooModel("qwen3", "decoder LM", "transformers Qwen3ForCausalLM",
             decoder("Qwen3ForCausalLM", "Qwen3Config", **TINY_LM, head_dim=8), dtypes=LM_DTYPES),
    ZooModel("gemma", "decoder LM", "transformers GemmaForCausalLM",
             decoder("GemmaForCausalLM", "GemmaConfig", **TINY_LM, head_dim=8), dtypes=LM_DTYPES),
    ZooModel("gemma2", "decoder LM (sliding window)", "transformers Gemma2ForCausalLM",
             decoder("Gemma2ForCausalLM", "Gemma2Config", **TINY_LM, head_dim=8, sliding_window=4),
             dtypes=LM_DTYPES),
    ZooModel("gemma3", "decoder LM (sliding window)", "transformers Gemma3ForCausalLM",
             decoder("Gemma3ForCausalLM", "Gemma3TextConfig", **TINY_LM, head_dim=8, sliding_window=4),
             dtypes=LM_DTYPES),
    ZooModel("mistral", "decoder LM (sliding window)", "transformers MistralForCausalLM",
             decoder("MistralForCausalLM", "MistralConfig", **TINY_LM, sliding_window=4), dtypes=LM_DTYPES),
    ZooModel("phi", "decoder LM", "transformers PhiForCausalLM",
             decoder("PhiForCausalLM", "PhiConfig", **TINY_LM), dtypes=LM_DTYPES),
    ZooModel("phi3", "decoder LM", "transformers Phi3ForCausalLM",
             decoder("Phi3ForCausalLM", "Phi3Config", **TINY_LM, pad_token_id=0), dtypes=LM_DTYPES),
    ZooModel("gpt2", "decoder LM", "transformers GPT2LMHeadModel",
             decoder("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64),
             dtypes=LM_DTYPES),
    ZooModel("gpt-neox", "decoder LM", "transformers GPTNeoXForCausalLM",
             decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64), dtypes=LM_DTYPES),
    ZooModel("olmo2", "decoder LM", "transformers Olmo2ForCausalLM",
             decoder("Olmo2ForCausalLM", "Olmo2Config", **TINY_LM), dtypes=LM_DTYPES),
    ZooModel("granite", "decoder LM", "transformers GraniteForCausalLM",
             decoder("GraniteForCausalLM", "GraniteConfig", **TINY_LM), dtypes=LM_DTYPES),
    ZooModel("llama-static-cache", "decoder LM (ExecuTorch recipe)",
             "transformers TorchExportableModuleWithStaticCache (TorchExportableModuleForDecoderOnlyLM) on LlamaForCausalLM",
             static_cache_lm("LlamaForCausalLM", "LlamaConfig", **TINY_LM), strict=True, dtypes=LM_DTYPES),
    ZooModel("gemma3-hybrid-cache", "decoder LM (ExecuTorch recipe)",
             "transformers TorchExportableModuleWithHybridCache (TorchExportableModuleForDecoderOnlyLM) on Gemma3ForCausalLM",
             static_cache_lm("Gemma3ForCausalLM", "Gemma3TextConfig", **TINY_LM, head_dim=8, sliding_window=4),
             strict=True, dtypes=LM_DTYPES),
    # ------------------------------------------------------------ mixture of experts
    ZooModel("mixtral", "MoE LM", "transformers MixtralForCausalLM",
             decoder("MixtralForCausalLM", "MixtralConfig", **TINY_MOE), dtypes=LM_DTYPES),
    ZooModel("qwen3-moe", "MoE LM", "transformers Qwen3MoeForCausalLM",
             decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **TINY_LM, head_dim=8, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32), dtypes=LM_DTYPES),
    # ------------------------------------------------------------ encoder-decoders
    ZooModel("t5", "encoder-decoder", "transformers T5ForConditionalGeneration",
             seq2seq("T5ForConditionalGeneration", "T5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2,
                     num_heads=4, decoder_start_token_id=0)),
    ZooModel("bart", "encoder-decoder", "transformers BartForConditionalGeneration",
             seq2seq("BartForConditionalGeneration", "BartConfig", d_model=32, encoder_layers=2,
                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
    ZooModel("whisper", "encoder-decoder (audio)", "transformers WhisperForConditionalGeneration",
             _whisper),
    # ------------------------------------------------------------ vision
    ZooModel("vit", "vision", "transformers ViTModel", image("ViTModel", "ViTConfig", **TINY_VIT)),
    ZooModel("deit", "vision", "transformers DeiTModel", image("DeiTModel", "DeiTConfig", **TINY_VIT)),
    ZooModel("dinov2", "vision", "transformers Dinov2Model", image("Dinov2Model", "Dinov2Config", **TINY_VIT)),
    ZooModel("clip-vision", "vision", "transformers CLIPVisionModel",
             image("CLIPVisionModel", "CLIPVisionConfig", **TINY_VIT)),
    ZooModel("siglip-vision", "vision", "transformers SiglipVisionModel",
             image("SiglipVisionModel", "SiglipVisionConfig", **TINY_VIT)),
    ZooModel("swin", "vision", "transformers SwinModel",
             image("SwinModel", "SwinConfig", image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                   num_heads=[2, 4], window_size=4)),
    ZooModel("convnext", "vision", "transformers ConvNextModel",
             image("ConvNextModel", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
    ZooModel("resnet", "vision", "transformers ResNetForImageClassification",
             image("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                   depths=[1, 1], num_labels=10)),
    ZooModel("regnet", "vision", "transformers RegNetModel",
             image("RegNetModel", "RegNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                   groups_width=4)),
    ZooModel("mobilenet-v1", "vision", "transformers MobileNetV1Model",
             image("MobileNetV1Model", "MobileNetV1Config", image_size=32, depth_multiplier=0.25)),
    ZooModel("mobilenet-v2", "vision", "transformers MobileNetV2Model",
             image("MobileNetV2Model", "MobileNetV2Config", image_size=32, depth_multiplier=0.25)),
    ZooModel("efficientnet", "vision", "transformers EfficientNetModel",
             image("EfficientNetModel", "EfficientNetConfig", image_size=32, width_coefficient=0.1,
                   depth_coefficient=0.1, hidden_dim=128)),
    ZooModel("mobilevit", "vision", "transformers MobileViTModel",
             image("MobileViTModel", "MobileViTConfig", image_size=32, hidden_sizes=[16, 24, 32],
                   neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64])),
    ZooModel("segformer", "vision (segmentation)", "transformers SegformerModel",
             image("SegformerModel", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                   hidden_sizes=[8, 16], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                   decoder_hidden_size=16)),
    ZooModel("yolos", "vision (detection)", "transformers YolosForObjectDetection",
             image("YolosForObjectDetection", "YolosConfig", image_size=[32, 32], patch_size=8, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_detection_tokens=4,
                   initializer_range=0.5)),  # the default init leaves the heads near zero
    # ------------------------------------------------------------ audio
    ZooModel("wav2vec2", "audio", "transformers Wav2Vec2Model", audio("Wav2Vec2Model", "Wav2Vec2Config", **TINY_W2V)),
    ZooModel("hubert", "audio", "transformers HubertModel", audio("HubertModel", "HubertConfig", **TINY_W2V)),
    ZooModel("wavlm", "audio", "transformers WavLMModel", audio("WavLMModel", "WavLMConfig", **TINY_W2V)),
    ZooModel("parakeet-ctc", "audio", "transformers ParakeetForCTC", _parakeet),
    ZooModel("audio-spectrogram-transformer", "audio", "transformers ASTModel",
             audio("ASTModel", "ASTConfig", key="input_values", shape=(64, 16), max_length=64, num_mel_bins=16,
                   hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
    # ------------------------------------------------------------ torch building blocks
    ZooModel("nn.TransformerEncoderLayer", "torch.nn", "torch.nn.TransformerEncoderLayer(batch_first=True)",
             torch_module(lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                          src=lambda b: torch.randn(b, 7, 32))),
    ZooModel("nn.TransformerDecoderLayer", "torch.nn", "torch.nn.TransformerDecoderLayer(batch_first=True)",
             torch_module(lambda: nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                          tgt=lambda b: torch.randn(b, 5, 32), memory=lambda b: torch.randn(b, 7, 32))),
    ZooModel("nn.Transformer", "torch.nn", "torch.nn.Transformer(batch_first=True)",
             torch_module(lambda: nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True),
                          src=lambda b: torch.randn(b, 7, 32), tgt=lambda b: torch.randn(b, 5, 32))),
    ZooModel("nn.MultiheadAttention", "torch.nn", "torch.nn.MultiheadAttention(batch_first=True)",
             torch_module(lambda: nn.MultiheadAttention(32, 4, batch_first=True),
                          query=lambda b: torch.randn(b, 5, 32), key=lambda b: torch.randn(b, 7, 32),
                          value=lambda b: torch.randn(b, 7, 32))),
    ZooModel("nn.LSTM", "torch.nn", "torch.nn.LSTM(num_layers=2, batch_first=True)",
             torch_module(lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True),
                          input=lambda b: torch.randn(b, 6, 16))),
    ZooModel("nn.GRU", "torch.nn", "torch.nn.GRU(bidirectional=True, batch_first=True)",
             torch_module(lambda: nn.GRU(16, 32, bidirectional=True, batch_first=True),
                          input=lambda b: torch.randn(b, 6, 16))),
    ZooModel("nn.Conv1d", "torch.nn", "torch.nn.Conv1d", torch_module(
        lambda: nn.Conv1d(8, 16, 5, stride=2, padding=2), input=lambda b: torch.randn(b, 8, 40))),
    ZooModel("nn.Conv2d", "torch.nn", "torch.nn.Conv2d (grouped, dilated)", torch_module(
        lambda: nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=2), input=lambda b: torch.randn(b, 8, 20, 20))),
    ZooModel("nn.Conv3d", "torch.nn", "torch.nn.Conv3d", torch_module(
        lambda: nn.Conv3d(4, 8, 3, stride=(1, 2, 2), padding=1), input=lambda b: torch.randn(b, 4, 6, 12, 12))),
    ZooModel("nn.ConvTranspose2d", "torch.nn", "torch.nn.ConvTranspose2d", torch_module(
        lambda: nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), input=lambda b: torch.randn(b, 8, 10, 10))),
    ZooModel("nn.ConvTranspose1d", "torch.nn", "torch.nn.ConvTranspose1d", torch_module(
        lambda: nn.ConvTranspose1d(8, 4, 5, stride=3, padding=1, output_padding=1),
        input=lambda b: torch.randn(b, 8, 16))),
]


BY_NAME = {m.name: m for m in MODELS}
