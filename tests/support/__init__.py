"""The machinery the tests share: a real hub server (olah), network namespaces, the pinned third-party sdists and
the llama.cpp build made from one of them, the models' own chat templates, a zoo of tiny models, and the helpers
test modules import (:mod:`tests.support.helpers`)."""
