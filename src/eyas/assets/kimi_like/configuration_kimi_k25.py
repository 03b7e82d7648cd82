"""Config of the Kimi-K2.5-like test wrapper (remote code, loaded with trust_remote_code=True).

Shaped like moonshotai/Kimi-K2.5's own `configuration_kimi_k25.py`: a multimodal wrapper config
whose `text_config` is a DeepSeek-V3 config and whose `vision_config` describes a vision tower.
`model_type` is "kimi_k25_like", not "kimi_k25", so transformers versions that ship a native
Kimi-K2.5 class never substitute it for this code (the fixture behaves the same everywhere).
"""

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_like_vision"

    def __init__(self, hidden_size=32, patch_size=4, num_channels=3, **kwargs):
        self.hidden_size = hidden_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        super().__init__(**kwargs)


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25_like"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=None,
                 tie_word_embeddings=False, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        if isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else KimiK25VisionConfig()
        # The token id whose positions receive projected image features.
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
