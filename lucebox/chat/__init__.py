"""Chat: a conversation over one engine (`session.ChatSession`, from `LLM.chat`), the conversation
as the model sees it (`conversation`), and the terminal command (`command`) with its slash
commands (`slash_commands`)."""

from lucebox.chat.session import ChatSession

__all__ = ["ChatSession"]
