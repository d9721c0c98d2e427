"""Models: the Vision Transformer, BiT ResNets (baselines and hybrid stems), the registry."""

from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.registry import build_model, count_parameters, create_model, get_config, model_names
from vitlab.models.resnet import ResNet
from vitlab.models.vit import VisionTransformer

__all__ = [
    "ResNet", "ResNetConfig", "ViTConfig", "VisionTransformer",
    "build_model", "count_parameters", "create_model", "get_config", "model_names",
]
