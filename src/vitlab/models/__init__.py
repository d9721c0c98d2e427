"""Models: the Vision Transformer, the ResNets (standard BatchNorm, BiT, the hybrid stem's units), the registry."""

from vitlab.models.config import ResNetConfig, ViTConfig
from vitlab.models.registry import build_model, count_parameters, create_model, get_config, model_names
from vitlab.models.resnet import ResNet
from vitlab.models.resnet_standard import StandardResNet
from vitlab.models.vit import VisionTransformer

__all__ = [
    "ResNet", "ResNetConfig", "StandardResNet", "ViTConfig", "VisionTransformer",
    "build_model", "count_parameters", "create_model", "get_config", "model_names",
]
