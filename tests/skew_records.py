"""The records both skew-gate tests check (tests/unit/test_skew_gate.py through transformers,
tests/vllm/test_skew_vllm.py through vLLM too): every record kind, multi-turn and with a system turn."""

from __future__ import annotations

from posttrain.data.records import ChatRecord, PreferenceRecord, PromptRecord

CHATS = [
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "7 * 6?"},
     {"role": "assistant", "content": "42"}, {"role": "user", "content": "and 6 * 7?"},
     {"role": "assistant", "content": "Also 42."}],
]


def records() -> list:
    chats = [ChatRecord(messages=m, source="chats", line=i + 1) for i, m in enumerate(CHATS)]
    pairs = [PreferenceRecord(prompt=[{"role": "user", "content": "Say hi"}],
                              chosen=[{"role": "assistant", "content": "Hi!"}],
                              rejected=[{"role": "assistant", "content": "No."}], source="pairs", line=1)]
    prompts = [PromptRecord(prompt=[{"role": "user", "content": "3 + 4 = ?"}], reference="7", meta={},
                            source="prompts", line=1)]
    return chats + pairs + prompts
