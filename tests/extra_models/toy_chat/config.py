"""The toy chat model's ``EntryClass``: a chat model whose request schema, capabilities
(text only, no audio output), pipeline and sample request are declared here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Self

from pydantic import Field

from omnistage.config.pipeline import FactoryConfig, StageConfig
from omnistage.serve.chat_media import ChatText, ChatTurn
from omnistage.serve.chat_protocol import ChatCapabilities, ChatCompletionRequest
from omnistage.serve.model import ChatModelConfig
from tests.extra_models.toy_chat.stages import ToyChatRequest

ARCHITECTURE = "ToyChatForTesting"
_HERE = "tests.extra_models.toy_chat"


class ToyChatCompletionRequest(ChatCompletionRequest):
    """``POST /v1/chat/completions`` for the toy model: OpenAI's fields plus one."""

    shout: bool = Field(default=False, description="reply in upper case")


class ToyChatConfig(ChatModelConfig):
    architecture = ARCHITECTURE
    chat_request = ToyChatCompletionRequest

    @classmethod
    def for_model_path(cls, model_path: str) -> Self:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        if config.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"{model_path}/config.json is not a {ARCHITECTURE} checkpoint")
        return cls(
            name=f"toy_chat:{Path(model_path).name}",
            model_path=model_path,
            stages=[
                StageConfig(
                    name="reply",
                    factory=FactoryConfig(path=f"{_HERE}.stages:create_reply_stage"),
                    terminal=True,
                    result_type="omnistage.core.payloads:TextResult",
                    stream_types=["omnistage.core.payloads:TextDelta"],
                ),
            ],
        )

    def capabilities(self) -> ChatCapabilities:
        assert self.model_path is not None
        return ChatCapabilities(
            model_names=(Path(self.model_path).name, "toy-chat"), model_type="toy_chat",
            supported_fields=frozenset({"shout"}), max_tokens_limit=64, default_max_tokens=16,
        )  # fmt: skip

    def build_request(self, request: ToyChatCompletionRequest, turns: tuple[ChatTurn, ...]) -> ToyChatRequest:
        texts = [(turn.role, part.text) for turn in turns for part in turn.parts if isinstance(part, ChatText)]
        last_user = next(text for role, text in reversed(texts) if role == "user")
        prompt = " ".join(text for _, text in texts)
        return ToyChatRequest(prompt, last_user, request.shout, request.completion_cap or 16)

    def sample_requests(self) -> list[ToyChatCompletionRequest]:
        return [ToyChatCompletionRequest(messages=[{"role": "user", "content": "Hello there."}], shout=True)]


EntryClass = ToyChatConfig
