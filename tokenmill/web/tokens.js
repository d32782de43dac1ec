// Tokens as spans tinted by their probability, and the popover that shows what else the model considered.
//
// The output is one tab stop (a roving tabindex): Tab reaches the current token, the arrow keys, Home and End move
// between tokens, and the focused or hovered token's top alternatives show in one shared popover.

const ALTERNATIVES = 5;
const INFO = new WeakMap(); // span → { text, logprob, top } as the server sent them

export function probability(logprob) {
  return logprob === null ? null : Math.exp(logprob);
}

export function percent(p) {
  if (p < 0.0001) return "<0.01%";
  return `${(p * 100).toFixed(p < 0.1 ? 2 : 1)}%`;
}

// A JSON string shows a token's leading spaces and newlines, which are the whole difference between many tokens.
export function shown(text) {
  return JSON.stringify(text);
}

// One span per token of an OpenAI logprobs object (or fragment of one, as a stream sends it).
export function tokenSpans(logprobs) {
  return logprobs.tokens.map((text, i) => {
    const logprob = logprobs.token_logprobs[i];
    const span = document.createElement("span");
    span.className = logprob === null ? "tok none" : "tok";
    span.textContent = text;
    if (text === "") span.classList.add("empty"); // a token with no text of its own (a BOS): still hoverable
    if (logprob !== null) span.style.setProperty("--p", probability(logprob).toFixed(4));
    INFO.set(span, { text, logprob, top: logprobs.top_logprobs[i] });
    return span;
  });
}

export class TokenNavigator {
  constructor(output, popover) {
    this.output = output;
    this.popover = popover;
    this.current = null; // the token Tab lands on
    this.shownFor = null;
    output.addEventListener("focusin", (event) => this.#focused(event.target));
    output.addEventListener("focusout", () => this.#restore(null));
    output.addEventListener("mouseover", (event) => this.#hovered(event.target));
    output.addEventListener("mouseout", (event) => this.#left(event.relatedTarget));
    output.addEventListener("keydown", (event) => this.#key(event));
    const follow = () => this.shownFor && this.#place(this.shownFor);
    window.addEventListener("scroll", follow, { passive: true, capture: true });
    window.addEventListener("resize", follow);
  }

  reset() {
    this.current = null;
    this.hide();
  }

  adopt(spans) {
    for (const span of spans) {
      span.tabIndex = this.current ? -1 : 0;
      this.current ??= span;
    }
  }

  show(span) {
    const info = INFO.get(span);
    if (!info) return;
    if (this.shownFor && this.shownFor !== span) this.shownFor.removeAttribute("aria-describedby");
    this.shownFor = span;
    span.setAttribute("aria-describedby", this.popover.id);
    this.popover.replaceChildren(...popoverContent(info));
    this.popover.hidden = false;
    this.#place(span);
  }

  hide() {
    this.shownFor?.removeAttribute("aria-describedby");
    this.shownFor = null;
    this.popover.hidden = true;
  }

  #focused(target) {
    if (!INFO.has(target)) return;
    if (this.current && this.current !== target) this.current.tabIndex = -1;
    target.tabIndex = 0;
    this.current = target;
    this.show(target);
  }

  #hovered(target) {
    const span = target.closest?.(".tok");
    if (span) this.show(span);
  }

  #left(next) {
    if (!next?.closest?.(".tok")) this.#restore(document.activeElement);
  }

  // Back to the focused token's popover, if a token has focus; else none.
  #restore(focused) {
    if (focused && INFO.has(focused) && this.output.contains(focused)) this.show(focused);
    else this.hide();
  }

  #key(event) {
    if (!INFO.has(event.target)) return;
    if (event.key === "Escape") {
      this.hide();
      return;
    }
    const tokens = [...this.output.querySelectorAll(".tok")];
    const at = tokens.indexOf(event.target);
    const to = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tokens.length - 1 }[event.key];
    if (to === undefined) return;
    event.preventDefault();
    tokens[Math.max(0, Math.min(to, tokens.length - 1))].focus();
  }

  // Below the token, or above it when the window has no room below; kept inside the window sideways.
  #place(span) {
    const box = span.getBoundingClientRect();
    const pop = this.popover.getBoundingClientRect();
    const gap = 6;
    const below = box.bottom + gap + pop.height <= window.innerHeight;
    const top = below ? box.bottom + gap : Math.max(gap, box.top - gap - pop.height);
    const left = Math.max(gap, Math.min(box.left, window.innerWidth - pop.width - gap));
    this.popover.style.setProperty("--top", `${top}px`);
    this.popover.style.setProperty("--left", `${left}px`);
  }
}

function popoverContent({ text, logprob, top }) {
  const head = element("div", "pop-head");
  head.append(element("code", "pop-token", shown(text)));
  if (logprob === null) {
    const note = "No probability: nothing comes before the first token to predict it from.";
    return [head, element("p", "pop-note", note)];
  }
  head.append(element("span", "pop-p", percent(probability(logprob))));
  head.append(element("span", "pop-lp", `logprob ${logprob.toFixed(3)}`));
  const ranked = Object.entries(top ?? {}).sort((a, b) => b[1] - a[1]);
  const list = element("ol", "alts");
  list.setAttribute("aria-label", `Top ${ALTERNATIVES} alternatives`);
  list.append(...ranked.slice(0, ALTERNATIVES).map(([alt, lp]) => alternative(alt, lp, alt === text)));
  const parts = [head, list];
  if (!ranked.slice(0, ALTERNATIVES).some(([alt]) => alt === text)) {
    parts.push(element("p", "pop-note", `This token was not among the ${ALTERNATIVES} likeliest.`));
  }
  return parts;
}

function alternative(text, logprob, chosen) {
  const p = probability(logprob);
  const item = element("li", chosen ? "alt chosen" : "alt");
  const bar = element("span", "bar");
  bar.style.setProperty("--w", p.toFixed(4));
  item.append(element("code", "", shown(text)), bar, element("span", "alt-p", percent(p)));
  return item;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
