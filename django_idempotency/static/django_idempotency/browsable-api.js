/* The browsable API's Idempotency-Key field (django_idempotency.browsable).
 *
 * Sends the field's value as the header with every guarded request the page's forms make, and
 * fills in the key for the next request once an answer came back:
 *   - a new key after a final answer (stored, or refused before anything was done);
 *   - the same key after no answer at all, a 409 (the first request is still running) or a 5xx
 *     (nothing was stored): sending the same request again with it is safe.
 * DRF replaces the whole page with the answer, so the outcome of the last request is kept in
 * sessionStorage for the page that follows.
 *
 * DRF sends its HTML form's POST as a plain browser submission, which cannot carry a header;
 * for a guarded POST this script sends it by AJAX instead, as DRF sends its other forms.
 */
(function () {
  "use strict";

  var $ = window.jQuery;
  var panel = document.getElementById("idempotency-key-panel");
  if (!panel || !$) {
    return;
  }
  var input = document.getElementById("idempotency-key");
  var note = document.getElementById("idempotency-key-note");
  var header = panel.getAttribute("data-header");
  var replayHeader = panel.getAttribute("data-replay-header");
  var methods = panel.getAttribute("data-methods").split(" ");
  var STORE = "django_idempotency.browsable_api.last_answer";

  function newKey() {
    var bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40; // a version 4 UUID
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    var hex = Array.prototype.map
      .call(bytes, function (b) { return (b + 0x100).toString(16).slice(1); })
      .join("");
    return [hex.slice(0, 8), hex.slice(8, 12), hex.slice(12, 16), hex.slice(16, 20),
            hex.slice(20)].join("-");
  }

  function guarded(method) {
    return methods.indexOf(String(method || "GET").toUpperCase()) !== -1;
  }

  function pathOf(url) {
    return new URL(url || window.location.href, window.location.href).pathname;
  }

  function unanswered(status) {
    return status === 0 || status === 409 || status >= 500;
  }

  function remember(answer) {
    try {
      window.sessionStorage.setItem(STORE, JSON.stringify(answer));
    } catch (error) { /* private mode: the next page gets a new key */ }
  }

  function recall() {
    try {
      var answer = JSON.parse(window.sessionStorage.getItem(STORE));
      window.sessionStorage.removeItem(STORE);
      return answer && answer.path === window.location.pathname ? answer : null;
    } catch (error) {
      return null;
    }
  }

  var last = recall();
  if (last && unanswered(last.status)) {
    input.value = last.key;
    note.textContent = "The last request with this key got " +
      (last.status ? "HTTP " + last.status : "no answer") +
      ": sending the same request again with the same key is safe (it runs once, or replays).";
  } else {
    input.value = newKey();
    if (last && last.replayed) {
      note.textContent = "Replayed: the answer above is the one stored for key " + last.key +
        "; nothing was done again.";
    }
  }
  document.getElementById("idempotency-key-new").addEventListener("click", function () {
    input.value = newKey();
    note.textContent = "";
  });

  // Every guarded request sent with jQuery from this page (DRF's forms, and the POST below).
  $.ajaxPrefilter(function (options, originalOptions, jqXHR) {
    if (!guarded(options.type) || options.crossDomain || !input.value) {
      return;
    }
    var key = input.value;
    var path = pathOf(options.url);
    jqXHR.setRequestHeader(header, key);
    // Registered before DRF's own handler, which replaces the page with the answer.
    jqXHR.always(function () {
      remember({
        path: path,
        key: key,
        status: jqXHR.status,
        replayed: jqXHR.getResponseHeader(replayHeader) === "true"
      });
    });
  });

  function show(xhr, url) {
    var type = (xhr.getResponseHeader("Content-Type") || "").toLowerCase();
    if (type.indexOf("text/html") === 0) {
      window.replaceDocument(xhr.responseText); // DRF's, from ajax-form.js
      window.history.replaceState({}, "", url);
      window.scroll(0, 0);
    } else {
      window.location = url;
    }
  }

  // Bound after DRF's handlers (load-ajax-form.js), so DRF has already taken the forms it sends
  // by AJAX; what it left to the browser and is guarded goes by AJAX here.
  $(function () {
    $("form").on("submit", function (event) {
      var form = this;
      if (event.isDefaultPrevented() || !guarded(form.getAttribute("method"))) {
        return;
      }
      event.preventDefault();
      var url = form.getAttribute("action") || window.location.href;
      var data = new FormData(form);
      // The CSRF token goes in the header (DRF's csrf.js): in the body it would differ from
      // one page to the next and make a resent form a different request.
      data.delete("csrfmiddlewaretoken");
      $.ajax({
        url: url,
        method: "POST",
        data: data,
        contentType: false,
        processData: false,
        headers: { Accept: "text/html; q=1.0, */*" }
      }).always(function (first, textStatus, third) {
        show(textStatus === "success" ? third : first, url);
      });
    });

    // Put the field above the page's forms.
    var forms = document.querySelector("#content .well.tab-content");
    if (forms && forms.parentNode) {
      forms.parentNode.parentNode.insertBefore(panel, forms.parentNode);
    }
  });
})();
