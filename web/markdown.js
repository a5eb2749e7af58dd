// Markdown of model replies: parsed by marked, sanitized by DOMPurify into a DOM fragment
// (never assigned as an HTML string), code blocks highlighted by highlight.js with a copy
// button. All three are pinned copies under /static/vendor (make vendor).
"use strict";

const MARKDOWN_FORBID = ["img", "svg", "math", "style", "form", "input", "button", "textarea", "select", "iframe", "object", "embed", "video", "audio", "picture", "source"];

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Raw HTML in a reply (a block or inline tag) is shown as the text it is, never parsed:
// the sanitizer below only ever sees the markup marked makes itself.
marked.use({ gfm: true, breaks: false, async: false, renderer: { html: (token) => escapeHtml(token.text) } });

hljs.configure({ ignoreUnescapedHTML: true });

// Links open in a new tab without handing the page over to them; the only class kept is a
// code fence's language (for the highlighter), so no markup can borrow the page's styles.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
  const cls = node.getAttribute && node.getAttribute("class");
  if (cls !== null && cls !== undefined && !(node.tagName === "CODE" && /^language-[\w+#.-]{1,40}$/.test(cls))) {
    node.removeAttribute("class");
  }
});

function copyButton(code) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "Copy";
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code.textContent);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
  return button;
}

// The reply's text as a sanitized fragment of elements, ready to append.
function renderMarkdown(text) {
  const html = marked.parse(text);
  const fragment = DOMPurify.sanitize(html, {
    RETURN_DOM_FRAGMENT: true,
    FORBID_TAGS: MARKDOWN_FORBID,
    FORBID_ATTR: ["style", "id"],
  });
  for (const code of fragment.querySelectorAll("pre > code")) {
    hljs.highlightElement(code); // escapes the text it highlights
    const pre = code.parentElement;
    const wrap = document.createElement("div");
    wrap.className = "code-block";
    pre.replaceWith(wrap);
    wrap.append(copyButton(code), pre);
  }
  return fragment;
}
