"""What a run is asked to do: spawn's arguments, and the spec a run is journaled with.

`SpawnArguments` is the one model of the arguments spawn and run take: the MCP tools publish its
fields (with their descriptions and limits) as their own arguments, and the Tasks path validates
a run call's raw arguments against it. `RunSpec` is the same with the model named (the
runtime's default filled in); it is what the journal records and a restart reads back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# lifecycle.CLASSES as a type (a Literal takes no names); tests/runtime check that the two agree.
ServiceClass = Literal["interactive", "batch"]

DEFAULT_MAX_TOOL_CALLS = 8
DEFAULT_MAX_TOKENS = 256


class SpawnArguments(BaseModel):
    """The arguments of spawn (and of run, which takes spawn's); field names are the tool's."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    task: Annotated[str, Field(description="what the sub-agent should do: its first user message")]
    model: Annotated[str | None, Field(description="model to run on; default: the runtime's")] = None
    serviceClass: Annotated[
        ServiceClass, Field(description="interactive (someone waits on it) or batch (background)")
    ] = "interactive"
    system: Annotated[str | None, Field(description="system prompt for the sub-agent")] = None
    maxToolCalls: Annotated[
        int, Field(ge=0, description="tool calls it may make before it must answer (default 8)")
    ] = DEFAULT_MAX_TOOL_CALLS
    tools: Annotated[
        list[str] | None, Field(description="names of the tools it may use (see tools); default: all")
    ] = None
    maxTokens: Annotated[
        int,
        Field(ge=0, description="reply length limit per model turn (default 256); 0 leaves it to the engine"),
    ] = DEFAULT_MAX_TOKENS
    parallelToolCalls: Annotated[
        bool, Field(description="let the model ask for several tool calls per reply and run them at once")
    ] = False
    parent: Annotated[
        str | None, Field(description="handle of the run this one works for: it becomes that run's child")
    ] = None
    budgetTokens: Annotated[
        int | None, Field(ge=1, description="prompt+completion tokens this run and all runs under it may use")
    ] = None
    budgetToolCalls: Annotated[
        int | None, Field(ge=0, description="tool calls this run and all runs under it may make together")
    ] = None
    budgetSeconds: Annotated[
        float | None, Field(gt=0, description="seconds this run and all runs under it may take, from now")
    ] = None
    approveTools: Annotated[
        list[str] | None, Field(description="tools whose every call waits for the user's approval")
    ] = None

    @classmethod
    def of_call(cls, arguments: dict[str, Any]) -> SpawnArguments:
        """A call's raw arguments (the Tasks path, which the SDK does not validate): a null
        argument stands for its default, and names spawn does not take are ignored."""
        return cls.model_validate({k: v for k, v in arguments.items() if v is not None})

    def spec(self, default_model: str) -> RunSpec:
        """The run's spec: these arguments, with `default_model` when none is named."""
        return RunSpec.model_validate(
            {**self.model_dump(), "model": default_model if self.model is None else self.model}
        )


class RunSpec(SpawnArguments):
    """Everything spawn was asked for, as journaled, with the model named."""

    model: str

    def limits(self) -> dict[str, float]:
        """This run's budget limits by kind (tokens, toolCalls, seconds); empty without a budget."""
        values = {
            "tokens": self.budgetTokens,
            "toolCalls": self.budgetToolCalls,
            "seconds": self.budgetSeconds,
        }
        return {k: v for k, v in values.items() if v is not None}


def initial_messages(spec: RunSpec) -> list[dict[str, Any]]:
    """The conversation a run starts from: the optional system prompt, then the task."""
    messages: list[dict[str, Any]] = []
    if spec.system:
        messages.append({"role": "system", "content": spec.system})
    messages.append({"role": "user", "content": spec.task})
    return messages
