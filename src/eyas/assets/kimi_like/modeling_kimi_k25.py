"""Model of the Kimi-K2.5-like test wrapper (remote code, loaded with trust_remote_code=True).

Same module layout as moonshotai/Kimi-K2.5's remote code: `vision_tower` + `mm_projector` and a
full causal LM under `language_model`, so the decoder loop runs at `language_model.model`, its
layers are `language_model.model.layers` and the output head is `language_model.lm_head`. The
language model is transformers' own DeepseekV3ForCausalLM (dense first layer, then MoE, MLA
attention), as in Kimi-K2.5. The vision tower is a tiny patch embedding: enough to make this a
real multimodal wrapper whose text decoder must be found below it.
"""

from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class KimiK25VisionTower(nn.Module):
    """Patchify an image and embed each patch: (B, C, H, W) -> (B, patches, vision_hidden)."""

    def __init__(self, config):
        super().__init__()
        self.patch_embed = nn.Conv2d(config.num_channels, config.hidden_size,
                                     kernel_size=config.patch_size, stride=config.patch_size)
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, pixel_values):
        patches = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, P, Hv)
        return self.norm(patches)


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = KimiK25VisionTower(config.vision_config)
        self.mm_projector = nn.Linear(config.vision_config.hidden_size,
                                      config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.language_model.set_output_embeddings(value)

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)  # (B, T, H)
        if pixel_values is not None:
            # Image features replace the embeddings at the placeholder tokens, in order.
            features = self.mm_projector(self.vision_tower(pixel_values))  # (B, P, H)
            slots = input_ids == self.config.media_placeholder_token_id  # (B, T)
            flat = features.reshape(-1, features.shape[-1])[: int(slots.sum())]
            inputs_embeds = inputs_embeds.masked_scatter(
                slots.unsqueeze(-1), flat.to(inputs_embeds.dtype))
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                   position_ids=position_ids, labels=labels, **kwargs)


__all__ = ["KimiK25ForConditionalGeneration", "KimiK25PreTrainedModel"]
