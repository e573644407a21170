"""Model implementations; the registry (architecture name -> implementation) is `pagoda.models.registry`."""

from pagoda.config.architectures import MODEL_REGISTRY, SUPPORTED_ARCHITECTURES
from pagoda.models.registry import get_model_class

__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "get_model_class"]
