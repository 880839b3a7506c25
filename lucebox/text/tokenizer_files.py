"""A model folder's tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json,
special_tokens_map.json, chat_template.jinja), read as transformers reads them, into a `Tokenizer`."""

from __future__ import annotations

from pathlib import Path

import sentencepiece
import tokenizers

from lucebox import bounded_json
from lucebox.errors import JSONInputError, ModelNotFoundError, TokenizerError
from lucebox.model_files import MODEL_JSON_MAX_BYTES, inside_folder
from lucebox.text.chat_template import folder_chat_templates
from lucebox.text.tokenizer import Tokenizer

_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = bounded_json.loads(bounded_json.read_regular_file(path, "the tokenizer file", MODEL_JSON_MAX_BYTES),
                                  str(path), nonfinite=True)
    except JSONInputError as e:
        raise TokenizerError(f"{e}; re-download or delete it") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def load_tokenizer(folder: Path, config: dict, generation_config: dict | None,
                   vocab_size: int | None = None) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has neither tokenizer.json nor tokenizer.model. With
    `vocab_size` (the model's), a tokenizer that can produce an id the model has no row for is refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    json_file, sp_file = folder / "tokenizer.json", folder / "tokenizer.model"
    if not json_file.is_file() and not sp_file.is_file():
        return None  # token ids still work; require_tokenizer explains when text is needed
    for name in (*_FILES, "chat_template.jinja"):
        if (folder / name).exists():
            inside_folder(folder, name, folder)  # a link out of the folder is refused
    tok_config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    # transformers reads special_tokens_map.json only for configs without added_tokens_decoder, and lets it
    # win there; elsewhere it is a fallback at most
    has_added = "added_tokens_decoder" in tok_config
    tok_config = {**special_map, **tok_config} if has_added else {**tok_config, **special_map}
    path = json_file if json_file.is_file() else sp_file
    try:
        if path is json_file:
            backend = tokenizers.Tokenizer.from_file(str(path))
        else:
            backend = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # both libraries raise plain Exception/RuntimeError on a bad file
        raise TokenizerError(f"{path} cannot be parsed ({e}); re-download it") from e
    templates, source = folder_chat_templates(folder, tok_config)
    try:
        tokenizer = Tokenizer(folder, backend, tok_config, config, generation_config, templates, str(source))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise TokenizerError(f"the tokenizer files in {folder} hold a value of the wrong type or form "
                             f"({type(e).__name__}: {str(e)[:200]}); re-download them") from None
    if vocab_size is not None:
        tokenizer.check_vocabulary(vocab_size)
    return tokenizer
