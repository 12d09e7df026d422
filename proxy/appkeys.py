"""Typed application state."""

from __future__ import annotations

from aiohttp import web

from proxy.api.images import ImageSources
from proxy.config import ProxyConfig
from proxy.models import ModelRegistry
from proxy.sessions.registry import SessionRegistry
from proxy.teacher import TeacherService
from proxy.turns import TurnService
from relay.pool import WorkerPool
from relay.weights import WeightSync

CONFIG = web.AppKey("config", ProxyConfig)
POOL = web.AppKey("pool", WorkerPool)
MODELS = web.AppKey("models", ModelRegistry)
SESSIONS = web.AppKey("sessions", SessionRegistry)
SERVICE = web.AppKey("service", TurnService)
WEIGHTS = web.AppKey("weights", WeightSync)
IMAGES = web.AppKey("images", ImageSources)
TEACHER = web.AppKey("teacher", TeacherService)
